"""scripts/check-imports.py: each import rule fails on a small source tree that breaks it,
and passes the same tree without the breach. (tests/tools: tests of the checkout's own
tools, which the package and its tests/unit run do not ship.)"""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("check_imports", os.path.join(ROOT, "scripts", "check-imports.py"))
assert _spec is not None and _spec.loader is not None
checker = importlib.util.module_from_spec(_spec)
sys.modules["check_imports"] = checker   # dataclasses look their module up there
_spec.loader.exec_module(checker)

# a tree shaped like agent/: every part the rules name, each with one module
SKELETON = {
    "agent/__init__.py": '__version__ = "0"\n',
    "agent/config.py": "",
    "agent/cli.py": "class UserError(Exception):\n    pass\n",
    "agent/__main__.py": "from agent.cli import UserError\n",
    "agent/runtime/__init__.py": "",
    "agent/runtime/loop.py": "from agent.runtime.metrics import counter\n",
    "agent/runtime/metrics.py": "def counter():\n    pass\n",
    "agent/runtime/gcpolicy.py": "",
    "agent/runtime/seams.py": "from agent.coordination.fencing import Fence\n",
    "agent/jobs/__init__.py": "",
    "agent/jobs/view.py": "def _parse(x):\n    return x\n\n\ndef parse(x):\n    return _parse(x)\n",
    "agent/jobs/cli.py": "",
    "agent/cloud/__init__.py": "",
    "agent/cloud/ingest.py": "",
    "agent/coordination/__init__.py": "",
    "agent/coordination/etcd.py": "class EtcdClient:\n    def _call(self):\n        return 1\n",
    "agent/coordination/fencing.py": "class Fence:\n    pass\n",
    "agent/execute/__init__.py": "",
    "agent/execute/reaper.py": "class _Run:\n    pass\n",
    "agent/execute/executor.py": "",
    "agent/signals/__init__.py": "",
    "agent/signals/loader.py": "",
    "agent/signals/sensor.py": "",
    "agent/supervision/__init__.py": "",
    "agent/supervision/health.py": "",
    "agent/audit/__init__.py": "",
    "agent/demo/__init__.py": "",
    "agent/demo/scenario.py": "",
}


def check(tmp_path, **changes: str) -> list[str]:
    """Findings ("path: rule: message", without line numbers) of the skeleton with these
    modules changed or added (``jobs__view`` or ``"jobs/view"``: agent/jobs/view.py)."""
    files = dict(SKELETON)
    for name, source in changes.items():
        files["agent/" + (name if "/" in name else name.replace("__", "/")) + ".py"] = textwrap.dedent(source)
    for rel, source in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    findings, _ = checker.check(str(tmp_path))
    return [f"{f.path}: {f.rule}: {f.message}" for f in findings]


def test_the_skeleton_itself_is_clean(tmp_path):
    assert check(tmp_path) == []


def test_main_exits_1_on_a_finding_and_0_without(tmp_path, capsys):
    check(tmp_path)
    assert checker.main(["--root", str(tmp_path)]) == 0
    check(tmp_path, jobs__view="from agent.cloud import ingest\n")
    assert checker.main(["--root", str(tmp_path)]) == 1
    assert "agent/jobs/view.py:1: layers: jobs imports agent.cloud.ingest" in capsys.readouterr().out


@pytest.mark.parametrize("source", [
    "from agent.cloud import ingest\n",                              # module level
    "import agent.cloud.ingest\n",
    "def f():\n    from agent.cloud.ingest import x\n",              # function level counts too
    "from agent.supervision import health\n",
])
def test_a_package_importing_outside_its_row_fails(tmp_path, source):
    (finding,) = check(tmp_path, jobs__view=source)
    assert finding.startswith("agent/jobs/view.py: layers: jobs imports agent.")


def test_what_a_row_names_passes(tmp_path):
    assert check(tmp_path, jobs__view="""
        from agent.coordination.etcd import EtcdClient
        from agent.execute import executor
        from agent.runtime import gcpolicy, metrics
        from agent import config
        """) == []
    assert check(tmp_path, supervision__health="from agent.signals import sensor\n") == []


def test_the_runtime_imports_only_coordinations_fence(tmp_path):
    assert check(tmp_path) == []                 # the skeleton's seams imports agent.coordination.fencing
    (finding,) = check(tmp_path, runtime__gcpolicy="from agent.jobs import view\n")
    assert finding.startswith("agent/runtime/gcpolicy.py: layers: runtime imports agent.jobs.view: not in what runtime")
    (finding,) = check(tmp_path, runtime__loop="from agent.coordination.fencing import Fence\n")
    assert finding.startswith("agent/runtime/loop.py: upward: imports agent.coordination.fencing, a floor above it")


def test_only_the_cli_and_the_demo_import_the_daemon(tmp_path):
    daemon = {"daemon/__init__": "", "daemon/core": "class Daemon:\n    pass\n", "daemon/admin": ""}
    (finding,) = check(tmp_path, **daemon, cloud__ingest="""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from agent.daemon.core import Daemon
        """)
    assert "agent/cloud/ingest.py: upward: imports agent.daemon.core" in finding   # not layers: rule 7's
    assert check(tmp_path, **daemon, cli="def run():\n    from agent.daemon.core import Daemon\n") == []
    assert check(tmp_path, **daemon, demo__scenario="from agent.daemon.admin import query\n") == []
    assert check(tmp_path, **{**daemon, "daemon/admin": "from agent.cloud import ingest\n"}) == []
    (finding,) = check(tmp_path, **daemon, cloud__ingest="from agent.daemon.core import Daemon\n")
    assert "agent/cloud/ingest.py: layers: imports agent.daemon.core, which only cli, demo may import" in finding
    (finding,) = check(tmp_path, **{**daemon, "daemon/admin": "from agent.demo import scenario\n"})
    assert "agent/daemon/admin.py: layers: imports agent.demo.scenario, which only cli may import" in finding


def test_only_the_cli_imports_the_demo(tmp_path):
    assert check(tmp_path, cli="def demo():\n    from agent.demo import scenario\n") == []
    assert check(tmp_path, **{"demo/report": "from agent.demo import scenario\n"}) == []
    (finding,) = check(tmp_path, runtime__loop="from agent.demo import scenario\n")
    assert "imports agent.demo.scenario, which only cli may import" in finding


def test_only_the_loader_imports_bcc(tmp_path):
    assert check(tmp_path, signals__loader="def load():\n    from bcc import BPF\n") == []
    (finding,) = check(tmp_path, signals__sensor="import bcc\n")
    assert finding == "agent/signals/sensor.py: layers: imports bcc, which only agent.signals.loader may"


def test_only_a_command_module_imports_the_cli(tmp_path):
    assert check(tmp_path, jobs__cli="from agent.cli import UserError\n") == []
    (finding,) = check(tmp_path, jobs__view="from agent.cli import UserError\n")
    assert finding.startswith("agent/jobs/view.py: layers: jobs imports agent.cli")


def test_a_part_without_a_row_fails(tmp_path):
    assert check(tmp_path, **{"newpart/__init__": "", "newpart/x": ""}) == [
        "agent/newpart/__init__.py: layers: newpart has no row in MAY_IMPORT "
        "(scripts/check-imports.py): say what it may import",
        "scripts/check-imports.py: upward: newpart has no floor in RANK: say where it sits"]


@pytest.mark.parametrize("source", [
    "from agent.execute.reaper import _Run\n",
    "from .reaper import _Run\n",
    "def f():\n    from agent.execute.reaper import _Run as Run\n",
])
def test_importing_a_private_name_of_another_module_fails(tmp_path, source):
    (finding,) = check(tmp_path, execute__executor=source)
    assert finding == ("agent/execute/executor.py: private: imports _Run from agent.execute.reaper: "
                       "a private name of another module")


@pytest.mark.parametrize("source", [
    "from agent.jobs import view\nview._parse(1)\n",
    "from . import view\nview._parse(1)\n",
    "import agent.jobs.view as v\nx = v._parse\n",
    "import agent.jobs.view\nagent.jobs.view._parse(1)\n",
])
def test_reaching_a_private_name_through_a_module_fails(tmp_path, source):
    (finding,) = check(tmp_path, jobs__cli=source)
    assert "agent/jobs/cli.py: private: reaches _parse of module agent.jobs.view through" in finding


def test_a_module_using_its_own_private_names_passes(tmp_path):
    assert check(tmp_path, jobs__view="""
        import os
        from collections import namedtuple

        P = namedtuple("P", "a")


        def _parse(x):
            return x


        class Thing:
            def _step(self, other):
                return other._step(self) if other else self._step(None)

            def go(self):
                os._exit(0) if False else super()._x()
                return _parse(P(1)._replace(a=2)._asdict())
        """) == []


def test_calling_a_private_method_another_module_defines_fails(tmp_path):
    (finding,) = check(tmp_path, jobs__view="""
        def page(client):
            return client._call()
        """)
    assert finding == ("agent/jobs/view.py: private-call: calls _call() of client: a private method of "
                       "agent.coordination.etcd")
    (finding,) = check(tmp_path, jobs__view="""
        class Pager:
            def page(self):
                return self.client._call()
        """)
    assert "calls _call() of self.client: a private method of agent.coordination.etcd" in finding


def test_private_methods_of_other_libraries_are_notes_not_findings(tmp_path):
    check(tmp_path, coordination__etcd="def txn(c):\n    return c._ops_to_requests([])\n")
    findings, notes = checker.check(str(tmp_path))
    assert findings == []
    assert [n.message for n in notes] == ["calls _ops_to_requests() of c: a private method of another library"]


JOB = "class Job:\n    not_after: object = None\n\n\nclass Flags:\n    O_CLOEXEC = 1\n"


def test_getattr_of_an_attribute_our_classes_define_fails(tmp_path):
    (finding,) = check(tmp_path, jobs__document=JOB, jobs__view="""
        def expires(job):
            return getattr(job, "not_after", None)
        """)
    assert finding.startswith("agent/jobs/view.py: duck: getattr(job, 'not_after'): not_after defined by a class")
    (finding,) = check(tmp_path, jobs__document=JOB, jobs__view="""
        class Later:
            def set(self):
                self.retry_at = 1

        def due(job):
            for name in ("retry_at", "missing"):
                if hasattr(job, name):
                    return name
        """)
    assert "duck: hasattr(job, name): retry_at defined by a class" in finding


@pytest.mark.parametrize("source", [
    "import os\nFLAGS = getattr(os, 'O_CLOEXEC', 0)\n",                       # a module of another library
    "def f(job):\n    return getattr(job, '__name__', None)\n",                 # a dunder
    "def f(job):\n    return getattr(job, 'not_ours', None)\n",                 # no class of agent/ defines it
    "def f():\n    try:\n        pass\n    except OSError as exc:\n        return getattr(exc, 'not_after', None)\n",
    "import argparse\n\n\ndef f(args: argparse.Namespace):\n    return getattr(args, 'not_after', None)\n",
    "from argparse import Namespace\n\n\ndef f(args: 'Optional[Namespace]'):\n    return getattr(args, 'not_after', 0)\n",
])
def test_getattr_on_other_libraries_objects_passes(tmp_path, source):
    assert check(tmp_path, jobs__document=JOB, jobs__view=source) == []


def test_a_parameter_typed_any_or_with_our_type_is_no_exemption(tmp_path):
    for annotation in ("Any", "Job", "Optional[Job]"):
        (finding,) = check(tmp_path, jobs__document=JOB, jobs__view=f"""
            from typing import Any, Optional
            from agent.jobs.document import Job


            def f(job: {annotation}):
                return getattr(job, "not_after", None)
            """)
        assert "duck: getattr(job, 'not_after')" in finding


def test_a_duck_adapter_module_may_ask_other_libraries_objects(tmp_path):
    source = "def code(reply):\n    return getattr(reply, 'not_after', None)\n"
    assert check(tmp_path, jobs__document=JOB, coordination__etcd=source) == []
    assert "agent.coordination.etcd" in checker.DUCK_ADAPTERS


PROTOCOL = """
    from typing import Any, Protocol


    class Sink(Protocol):
        def f(self, x: Any) -> None: ...
    """


def test_any_in_a_seam_protocol_fails(tmp_path):
    (finding,) = check(tmp_path, jobs__seams=PROTOCOL)
    assert finding.startswith("agent/jobs/seams.py: seam-any: Any in seam Protocol Sink.f (parameter x): ")
    assert "TYPE_CHECKING" in finding
    (finding,) = check(tmp_path, jobs__seams="""
        from typing import Any, Protocol


        class Sink(Protocol):
            last: "dict[str, Any]"

            def g(self) -> None: ...
        """)
    assert "Any in seam Protocol Sink.last" in finding


def test_a_marked_line_and_json_keywords_pass(tmp_path):
    marked = PROTOCOL.replace("-> None: ...", "-> None: ...  # any: opaque")
    assert check(tmp_path, jobs__seams=marked) == []
    assert check(tmp_path, jobs__seams="""
        from typing import Any, Protocol


        class Sink(Protocol):
            def record(self, type_: str, *args: Any, **fields: Any) -> None: ...
        """) == []
    assert check(tmp_path, jobs__seams="from typing import Any\n\n\nclass Plain:\n    def f(self, x: Any): ...\n") == []


def test_any_in_a_callable_alias_a_protocol_names_fails(tmp_path):
    (finding,) = check(tmp_path, jobs__seams="""
        from typing import Any, Callable, Protocol

        OnExit = Callable[[Any, int], None]
        Unused = Callable[[Any], None]


        class Runs(Protocol):
            def start(self, on_exit: OnExit) -> None: ...
        """)
    assert finding.startswith("agent/jobs/seams.py: seam-any: Any in OnExit, a Callable alias seam Protocol Runs")
    (finding,) = check(tmp_path, execute__executor="from typing import Any, Callable\n\nDone = Callable[[Any], None]\n",
                       jobs__seams="""
        from typing import Protocol

        from agent.execute.executor import Done


        class Runs(Protocol):
            def start(self, done: Done) -> None: ...
        """)
    assert finding.startswith("agent/execute/executor.py: seam-any: Any in Done, a Callable alias")


def test_an_import_cycle_between_two_packages_fails(tmp_path):
    tc = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from agent.{} import X\n"
    (finding,) = check(tmp_path, **{"coordination/etcd": tc.format("execute.reaper"),
                                    "execute/reaper": tc.format("coordination.etcd")})
    assert finding.startswith("agent/coordination/etcd.py: cycles: an import cycle across coordination, execute "
                              "(TYPE_CHECKING imports count): agent.coordination.etcd, agent.execute.reaper;")


def test_a_cycle_inside_one_package_passes(tmp_path):
    assert check(tmp_path, **{"jobs/view": "from agent.jobs import cli\n", "jobs/cli": "from agent.jobs import view\n",
                              "config": "def load():\n    from agent import configcheck\n",
                              "configcheck": "from agent import config\n"}) == []


def test_an_import_of_a_higher_floor_fails(tmp_path):
    (finding,) = check(tmp_path, jobs__view="""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from agent.cloud.ingest import Ingest
        """)
    assert finding.startswith("agent/jobs/view.py: upward: imports agent.cloud.ingest, a floor above it")
    assert check(tmp_path, configcheck="from agent.jobs import paramregex\n",
                 **{"jobs/paramregex": ""}) == []          # UPWARD_ALLOWED, with its reason


def test_every_run_counts_each_rule_and_counts_prints_the_figures(tmp_path, capsys):
    check(tmp_path, jobs__document=JOB, jobs__view="def f(job):\n    return getattr(job, 'not_after', None)\n")
    assert checker.main(["--root", str(tmp_path), "--counts"]) == 1
    out = capsys.readouterr().out
    assert "agent/jobs/view.py:2: duck: getattr(job, 'not_after')" in out
    assert "check-imports: layers 0, private 0, private-call 0, seam-any 0, duck 1, cycles 0, upward 0" in out
    assert "duck (getattr/hasattr on our attribute names): 1" in out
    assert "cross-package import cycles: 0" in out and "upward imports: 0 module pairs" in out


def _doc_table(heading: str) -> dict[str, str]:
    """The first two columns of the table under ``heading`` in docs/development.md."""
    with open(os.path.join(ROOT, "docs", "development.md")) as fh:
        text = fh.read()
    rows: dict[str, str] = {}
    for line in text.split(heading, 1)[1].splitlines():
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1]
    rows.pop("---", None)
    rows.pop("module", None)
    rows.pop("import", None)
    return rows


def test_the_duck_adapters_in_the_docs_are_the_scripts():
    assert _doc_table("### Duck adapters") == checker.DUCK_ADAPTERS


def test_the_upward_imports_in_the_docs_are_the_scripts():
    assert _doc_table("### Upward imports") == {f"{a} → {b}": why for (a, b), why in checker.UPWARD_ALLOWED.items()}
