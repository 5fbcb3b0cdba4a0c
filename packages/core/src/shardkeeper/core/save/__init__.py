"""One rank's save: plan, stage, write, report (in commit/protocol.py's order), and the handle the caller holds."""

__all__: list[str] = []
