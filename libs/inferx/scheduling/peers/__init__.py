"""Peer policies: faithful, full-strength versions of what deployed LLM routers and
schedulers do, registered next to `round-robin` and `chain-aware` so every comparison
(`inferx sim --compare`, `inferx bench`, `inferx-scheduler --policy`) can use them.
Each module's docstring names the system it imitates and how faithfully."""
