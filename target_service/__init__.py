"""The target service: verifier and executor. It owns the committed sequences and their KV,
runs the step loop on its own thread, asks the draft service for trees and streams commits to
the gateway (docs/design.md section 2). ``python -m target_service``."""
