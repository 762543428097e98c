"""Text-to-video pipelines: the video medium of the pipeline tasks (`media.VIDEOS`)."""
