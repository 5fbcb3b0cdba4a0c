"""One rank's save: plan, stage, write."""
