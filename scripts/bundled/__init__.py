"""The bundled model's build pipeline (``scripts/train_bundled.py``): one noun per module.

corpus (Python source, splits, licences, needle templates), tok (tokenizer and token streams), batches
(packed training sequences and retrieval samples), target (the Qwen3.5 model and its training), mtp (the MTP
head), drafters (DFlash / DFlash2 training), export (HF folder -> artifact, shipping), evaluate (numbers for
the card), card (the model card).
"""
