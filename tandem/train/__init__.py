"""Training: the reference model family's recipe and ``tandem train-draft``.

``corpus`` collects documents (the interpreter's Python sources or given files) and splits them
train / held-out by path hash; ``tokenizer`` trains the byte-level BPE; ``blocks`` packs token
streams into fixed-length blocks; ``loop`` is the one optimisation loop every trainer runs;
``target`` trains a Llama target; ``features`` runs a target for its hidden states, logits and
greedy continuations; ``ttt`` unrolls a draft module over several steps (EAGLE-3's
training-time test) through the runtime's own module code; ``labels`` holds the target's
next-token distribution and the label loss; ``heads`` trains EAGLE-3, EAGLE-1 and MTP heads;
``standalone`` distils a small LM; ``draft`` dispatches and records; ``prompts`` cuts held-out
prompts; ``family`` renders a family's provenance; ``cli`` is the ``tandem train-draft``
command.
"""
