"""Data, whatever the model: files and folders read and checked (`sources`), their rows as
canonical records (`formats`: detection, columns, loading, splits; `convert`: one row of each
format), media files (`media`), the built-in data sets (`builtin`, `synthetic`), and the on-disk
cache's entries (`cache`: keyed, built under a temporary name, checked by a manifest).

How a model family turns records into what it trains on lives in its own room: the language
family tokenises them (`families.language.pipeline`, `encode`), the text-to-image family encodes
images into latents (`families.diffusion.latents`)."""

from align_anything.data.formats import FORMATS, DataReport

__all__ = ["FORMATS", "DataReport"]
