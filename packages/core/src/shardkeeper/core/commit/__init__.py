"""What "committed" means and how a step becomes committed: the protocol's records, the merge of reports, the manifest's put-if-absent, intents (torch-free)."""

__all__: list[str] = []
