"""The cluster simulator: predicted refit time on GPU clusters nobody here has, from the
same plans the executor runs (no torch). Cluster presets (:mod:`~reshard.sim.cluster`),
model presets and Hugging Face configs (:mod:`~reshard.sim.models`), parallel layouts
such as ``pp16,ep16`` (:mod:`~reshard.sim.specs`), the cost model
(:mod:`~reshard.sim.costmodel`) and sweeps and plots (:mod:`~reshard.sim.simulate`)."""
