"""The draft service: the proposer. It keeps draft KV mirrors of the target's running requests
and answers each ``Speculate`` step with their next trees (docs/design.md section 2).
``python -m draft_service``; ``server.py`` is the gRPC face, ``engine.py`` the drafter's thread."""
