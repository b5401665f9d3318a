"""Multi-turn episodes: environments that talk back and tools the model calls.

- `episode`: the loop, token-in/token-out (sampled ids kept as the generator returned them,
  environment turns appended as chat-template deltas, only sampled ids trained).
- `render`: the first prompt and each environment turn as ids (`ChatRenderer`).
- `environment`: the `Environment` protocol (reset, step), the built-in one-turn `Answer`.
- `tools`: plain functions, their JSON schema (signature + docstring), each call answered as a
  tool message whatever the function does.
- `tool_calls`: reading calls from a completion (Qwen3/Hermes, Llama 3, a user parser).
- `loading`, `timeout`: user objects from "file.py:Name", calls bounded in time.
"""
