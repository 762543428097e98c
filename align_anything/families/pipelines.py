"""The diffusers-pipeline families as one `ModelFamily` for the pipeline tasks
(`diffusion_sft`, `diffusion_dpo`): the shared steps (`families.diffusion.family`) with every
medium a family's room provides. A pipeline folder's kind says its medium
(`families.diffusion.kinds.MEDIUM`); adding a medium is a room and a line here."""

from __future__ import annotations

from align_anything.families.diffusion.family import Medium, pipeline_family
from align_anything.families.text_to_audio.media import AUDIO
from align_anything.families.text_to_image.media import IMAGES
from align_anything.families.text_to_video.media import VIDEOS

# Medium name -> what reads, draws and checks it.
MEDIA: dict[str, Medium] = {"image": IMAGES, "video": VIDEOS, "audio": AUDIO}

PIPELINES = pipeline_family("diffusion pipeline", MEDIA)
