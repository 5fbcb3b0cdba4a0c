"""Rules of the house: layering, module sizes, the public API, benchmark and script smoke runs."""
