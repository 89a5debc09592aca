"""A Spark driver with several executor processes (``local-cluster``), in a process of its own, that
runs the functions a test sends it.

Why a process of its own: a Python process holds one SparkContext, and the test run's shared session
(tests/conftest.py) is plain local mode, where the driver is the only executor. ``local-cluster[N,C,M]``
starts N executor JVMs, each with its own Python workers, as a real cluster does; it needs the pip
package's bin/ and jars/ (see cluster_environment).

Protocol: the driver connects to the parent's Unix socket ``address`` (in a directory only this user
can enter), which sends cloudpickled ``(function, args, kwargs)``; the driver answers
``("ok", result)`` or ``("error", traceback text)`` for each one, calling ``function(spark, *args, **kwargs)``.
The first message is ``("ready", {"executors": n, "seconds": s})`` once every executor registered.

A function may keep things (a running query) for later calls in ``sys.modules["__main__"].KEPT``.

Run as ``python cluster_driver.py ADDRESS EXECUTORS WORK_DIR``.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client as _Connect, Connection
from pathlib import Path
from typing import Any

EXECUTOR_MEMORY_MB = 1024
KEPT: dict[str, Any] = {}  # what functions keep across calls (in the driver process)


def cluster_environment(work_dir: Path) -> dict[str, str]:
    """What the driver process needs for local-cluster with the pip-installed pyspark.

    Its workers run in the driver's JVM and take their Spark home from $SPARK_HOME (pyspark's launcher
    sets it to the package directory): executors are started from its bin/ and jars/, and each gets a
    working directory under its work/ ($SPARK_WORKER_DIR counts only for a standalone worker). So
    SPARK_HOME is a directory of the test's own, whose entries link to the package's, and whose
    work/ is real: nothing is written into the virtual environment.
    """
    import pyspark

    package = Path(pyspark.__file__).parent
    home = work_dir / "spark-home"
    home.mkdir(exist_ok=True)
    for entry in package.iterdir():
        if entry.name != "work" and not (home / entry.name).exists():
            (home / entry.name).symlink_to(entry)
    (home / "work").mkdir(exist_ok=True)
    return {
        "SPARK_HOME": str(home),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    }


def _serve(address: str, executors: int, work_dir: Path) -> None:
    from pyspark import cloudpickle

    from zerocomm_spark.connector.session import local_spark

    began = time.monotonic()
    spark = local_spark(
        "zerocomm-executors", master=f"local-cluster[{executors},1,{EXECUTOR_MEMORY_MB}]",
        conf={"spark.executor.memory": f"{EXECUTOR_MEMORY_MB}m", "spark.sql.shuffle.partitions": str(executors * 2),
              # a failed task is retried (as on a cluster), not the query failed at once (local mode's 1)
              "spark.task.maxFailures": "4"})
    status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus()
    deadline = time.monotonic() + 180
    while status.size() < executors + 1 and time.monotonic() < deadline:  # the driver is listed too
        time.sleep(0.2)
        status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus()
    conn = _Connect(address, family="AF_UNIX")
    conn.send_bytes(cloudpickle.dumps(("ready", {"executors": status.size() - 1,
                                                 "seconds": round(time.monotonic() - began, 1)})))
    try:
        while True:
            try:
                request = conn.recv_bytes()
            except EOFError:
                return
            try:
                function, args, kwargs = cloudpickle.loads(request)
                answer: tuple[str, Any] = ("ok", function(spark, *args, **kwargs))
            except Exception:  # noqa: BLE001 - reported to the test, which fails with it
                answer = ("error", traceback.format_exc()[-6000:])
            try:
                data = cloudpickle.dumps(answer)
            except Exception:  # noqa: BLE001
                data = cloudpickle.dumps(("error", "the result could not be pickled:\n" + traceback.format_exc()))
            conn.send_bytes(data)
    finally:
        spark.stop()


class ClusterDriver:
    """The parent's handle: start the driver, call functions in it (each with a deadline), stop it."""

    def __init__(self, work_dir: Path, executors: int = 2, start_timeout: float = 240.0) -> None:
        self.work_dir = work_dir
        self.log = work_dir / "driver.log"
        self._dir = tempfile.mkdtemp(prefix="zc-cluster-", dir="/tmp")  # mode 0700; a short path for the socket
        address = os.path.join(self._dir, "driver.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(address)
        self._listener.listen(1)
        self.conn: Connection | None = None
        env = {**os.environ, **cluster_environment(work_dir)}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, __file__, address, str(executors), str(work_dir)],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         cwd=str(Path(__file__).resolve().parents[2]), start_new_session=True)
        try:
            self.conn = self._accept(start_timeout)
            ready = self._receive(start_timeout, "the local-cluster session to start")
        except BaseException:
            self.stop()
            raise
        self.executors: int = ready["executors"]
        self.start_seconds: float = ready["seconds"]

    def _accept(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the cluster driver exited ({self.proc.returncode}):\n{self.tail()}")
            if select.select([self._listener], [], [], 0.5)[0]:
                return Connection(self._listener.accept()[0].detach())
        raise AssertionError(f"the cluster driver did not start within {timeout}s:\n{self.tail()}")

    def _receive(self, timeout: float, what: str) -> Any:
        from pyspark import cloudpickle

        assert self.conn is not None
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.5):
            if self.proc.poll() is not None:
                raise AssertionError(f"the cluster driver exited ({self.proc.returncode}) during {what}:\n"
                                     f"{self.tail()}")
            if time.monotonic() > deadline:
                self.stop()  # a call that overran leaves the session in an unknown state
                raise AssertionError(f"timed out after {timeout}s waiting for {what}:\n{self.tail()}")
        state, value = cloudpickle.loads(self.conn.recv_bytes())
        if state == "error":
            raise AssertionError(f"{what} failed in the cluster driver:\n{value}")
        return value

    def call(self, function: Callable[..., Any], *args: Any, timeout: float = 180.0, **kwargs: Any) -> Any:
        """``function(spark, *args, **kwargs)`` in the driver; its result, or AssertionError with its traceback."""
        from pyspark import cloudpickle

        if self.conn is None or self.proc.poll() is not None:
            raise AssertionError(f"the cluster driver is not running:\n{self.tail()}")
        self.conn.send_bytes(cloudpickle.dumps((function, args, kwargs)))
        return self._receive(timeout, getattr(function, "__name__", "the call"))

    def tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 60.0) -> None:
        if self.conn is not None:
            self.conn.close()  # the driver stops its session at the end of its input
            self.conn = None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        try:  # whatever is left of its process group: the JVM, executors, Python workers
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
