"""Jobs: what the cloud asks for and when it runs.

Modules: document (job document parsing, validation, templates, canonical form),
signing (key ring, HMAC and Ed25519 signatures), schedule (due times, misfire, retry
backoff, fire ids), firing (a firing, its state Enum and transitions, the RunListener
seam, the run-record states), scheduler (due firings -> fenced run records ->
processes), claimlead (how far ahead of a due time a firing is claimed), view (what a
job is doing, read from etcd: the model behind jobs/get and the CLI), cli (`jobs`,
`runs`, `logs`).

May import: ``config``, ``coordination``, ``execute``, ``runtime`` leaves and
``runtime.gcpolicy``. Never imports ``cloud``, ``supervision`` or the daemon at run time;
it implements their seams (JobListener, RunGate) structurally.
"""
