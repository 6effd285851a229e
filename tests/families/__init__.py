"""One oracle test module per model family: test_<family>.py holds the family's tiny
transformers config and its variants, and runs the shared checks of tests/family_oracle.py.

A package so that pytest imports each module as `families.test_<family>` (tests/ on sys.path,
prepend mode), the same name tiny_checkpoints.hf_config imports it by: one module object, not two.
"""
