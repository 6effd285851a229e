"""Image inputs of vision-language checkpoints: decoding (decode.py) and the checkpoint's own
preprocessing (processor.py: resize, rescale, normalize, patchify, as its preprocessor_config.json
says). The vision towers that read the patches are models/vision/."""
