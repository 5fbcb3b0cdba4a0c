"""Operations built on save and restore: the interval advisor, export and import, the preemption guard."""

__all__: list[str] = []
