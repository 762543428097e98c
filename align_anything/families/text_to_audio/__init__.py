"""Text-to-audio pipelines (AudioLDM's layout), trained by the pipeline tasks: the audio medium
(`media.AUDIO`), reading and checking audio data and making spectrograms (`audio`), and the
tiny random pipeline of the tests (`tiny`)."""
