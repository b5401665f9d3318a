"""Multi-turn episodes: environments that talk back and tools the model calls.

- `tools`: plain functions, their JSON schema (signature + docstring), each call answered as a
  tool message whatever the function does.
- `tool_calls`: reading calls from a completion (Qwen3/Hermes, Llama 3, a user parser).
- `loading`, `timeout`: user objects from "file.py:Name", calls bounded in time.
"""
