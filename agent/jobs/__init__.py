"""Jobs: what the cloud asks for and when it runs.

Modules: envelope (size, JSON, signature, binding; JobRejected and the reason codes),
document (the job model and its validation, canonical form), render (argv, run id,
resources at run time),
signing (key ring, HMAC and Ed25519 signatures), schedule (due times, misfire, retry
backoff, fire ids), states (the record and status vocabularies), firing (a firing, its
state Enum and transitions, why it ended, the RunListener seam), and the firing pipeline:
seams (the Protocols it needs from the agent), catalog (the jobs a unit holds: load,
watch, trust, retirement), recovery (what a new owner finds and owes; pure), scheduler
(due times -> admission -> claim -> run -> final record), admitting (holds and node
quota), catchup (missed firings found at a load, started a few at a time while the
loop keeps up), dependencies (depends_on, watched), claims (the fenced claim and its
read-backs), records (run-record documents and fenced writes), launching (run spec,
prepare or start), outcomes (end reason -> state and retry; pure), statuses (status
documents), claimlead (how far ahead a firing is claimed), startpolicy (what is asked
before admission), approvals and approvalgate (four-eyes approval: pure, and its start
policy), rollout and rollouts (staged fleet rollouts: pure, and its etcd mechanism),
metrics. Then view (what a job
is doing, read from etcd: the model behind jobs/get and the CLI), cli (`jobs`, `runs`,
`logs`), retention (what is deleted and when), paramregex (template param regexes that
match in linear time) over regexsyntax (the regex subset they may use, parsed).

May import: ``config``, ``coordination``, ``execute``, ``runtime`` leaves and
``runtime.gcpolicy``. Never imports ``cloud``, ``supervision`` or the daemon at run time;
it implements their seams (JobListener, RunGate) structurally.
"""
