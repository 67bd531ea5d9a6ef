"""gateway: the public face of Tandem (docs/design.md section 2).

It owns the request lifecycle, the tokenizer and admission: `server.GatewayServicer` serves
`tandem.v1.GatewayService`, `target_client.TargetClient` keeps the one control stream to the
target, `admission.Admission` bounds what runs and waits, `detokenize` streams text and matches
stop strings. `python -m gateway` starts it. Lanes and the speculation policy come later.
"""
