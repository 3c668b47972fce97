"""The agent turn: prompt text, chat-template rendering (token-in/token-out), answer parsing."""
