"""Rollout: the engine Protocol, engines (hf, vllm, openai, scripted) and the multi-turn loop."""
