"""Training: ``python -m scripts.train.demo`` (the demo model, with its building blocks in ``demo_*``) and
``python -m scripts.train.drafter`` (a block drafter for any Unlimited-OCR checkpoint)."""
