"""What a rank reads: the user's sources, their cuts and features, tokenized examples, batches.

One module a job; import a name from the module that owns it:

- ``sources``, ``source_cuts``, ``storage``: what ``data.input_cfg`` and ``eval.sets`` name,
  loaded as lhotse cuts and checked, from disk or object storage;
- ``nemo_input_cfg``, ``nemo_manifest``: NeMo's formats, read as NeMo reads them;
- ``conversation``, ``conversation_cuts``: conversations and text pairs as cuts with turns;
- ``features``: acoustic features as the encoder expects them;
- ``text``, ``prompt``: the tokenizer, and an example as one sequence in an LLM's chat format;
- ``loader``: batches under the seed contract (the sampler, workers, collation);
- ``balance``, ``work``: a step's examples dealt to the ranks by what each costs the step;
- ``stream``, ``layout``: one rank's stream of batches and the saved position, and what that
  position depends on;
- ``plan``: what a job reads, resolved before any process group exists;
- ``batch_hash``: the fingerprints by which peers that must share a batch check they do.
"""
