"""RAGEN: multi-turn reinforcement learning of LLM agents (StarPO / StarPO-S).

The library never imports Prefect; orchestration lives in the top-level ``flows/`` package.
"""

__version__ = "0.1.0"
