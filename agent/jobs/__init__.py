"""Jobs: what the cloud asks for and when it runs.

Modules: envelope (size, JSON, signature, binding; JobRejected and the reason codes),
document (the job model and its validation, canonical form), render (argv, run id,
resources at run time),
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
