"""EAGLE-style draft heads (docs/speculation.md): a small decoder that drafts from the target's
own hidden states, loaded by `--speculative-model` when the folder's config says EagleHead."""
