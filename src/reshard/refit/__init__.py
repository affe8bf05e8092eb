"""The RL refit: a trainer job sends weight versions to an inference job.

* :class:`RefitSender` / :class:`RefitReceiver`: meet once, plan once, then one call
  per weight version, never torn (shadow + commit) -- :mod:`reshard.refit.side` has the
  protocol;
* :class:`ElasticSender` / :class:`ElasticReceiver`: the same across membership epochs;
* :func:`meet`: the rendezvous of two separately launched jobs.
"""

from reshard.refit.elastic import Announcement, ElasticReceiver, ElasticSender
from reshard.refit.receiver import RefitReceiver
from reshard.refit.rendezvous import Meeting, meet
from reshard.refit.sender import RefitSender
from reshard.refit.side import RefitStats, layouts_of

__all__ = ["Announcement", "ElasticReceiver", "ElasticSender", "Meeting", "RefitReceiver",
           "RefitSender", "RefitStats", "layouts_of", "meet"]
