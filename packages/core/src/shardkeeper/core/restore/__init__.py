"""One rank's restore: choose the step, plan, read ranges verified, fill the target; fall back past damaged steps."""

__all__: list[str] = []
