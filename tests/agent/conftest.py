"""Agent tests use the shared ``chatml_tokenizer`` fixture from tests/conftest.py."""
