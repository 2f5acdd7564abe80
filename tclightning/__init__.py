"""tclightning: communication-efficient GRPO for PyTorch Lightning.

Subpackages, one concept each:

* ``recipes``  -- typed recipe schema, YAML loading, includes, overrides, validation
* ``models``   -- HF / tiny / GGUF model and tokenizer loading, supervised warm-up
* ``tasks``    -- prompts + verifiers (arithmetic, GSM8K, MATH)
* ``sampling`` -- the dense sampler circuit (HF ``generate``; vLLM on GPU)
* ``grpo``     -- advantages, loss, the GRPO LightningModule and its data stream
* ``codecs``   -- boundary codecs (exact-k PRF, identity, low-rank)
* ``pipeline`` -- layouts, cuts and the pipeline Strategy
* ``anchor``   -- the dense anchor circuit, mergers and projectors
* ``health``   -- collapse detection rules (pure logic)
* ``callbacks``-- Lightning callbacks (monitoring, checkpoints, progress)
* ``probes``   -- analysis tools (cut pricing, inference sweep, trajectories)
* ``cli``      -- ``tclightning`` and ``lightning run``
* ``bench``    -- measurement tooling behind ``tclightning bench``, the rank launcher (not used by training)
"""

__version__ = "0.1.0"
