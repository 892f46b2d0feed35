"""Evaluation helpers: the project's long-chain reasoning task and its code corpus.

Everything here is standard-library only, so the CLI, the accuracy harness and the training script can
import it without pulling in torch or transformers.
"""
