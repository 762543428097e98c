"""The command-line tools beside `train`, each run as `python -m align_anything <command>`
(see `align_anything/__main__.py`): export, score, plot, presets, plan, docs."""
