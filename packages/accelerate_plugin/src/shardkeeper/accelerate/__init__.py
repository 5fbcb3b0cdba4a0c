"""shardkeeper adapter for Hugging Face Accelerate.

This adapter is a skeleton pending its issue: it exports nothing yet. When written, it hooks
into the accelerate config file and Accelerator.save_state / load_state, and translates the
framework's state to and from the canonical state of shardkeeper.core (DESIGN.md sections 2 and
5). It imports only the public API of shardkeeper.core and its own framework, never another
adapter.
"""

__all__: list[str] = []
