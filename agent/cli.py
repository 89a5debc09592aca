"""The zerocomm command line (filled in by the agent issue)."""
def main() -> int:
    raise SystemExit("zerocomm: the command line arrives with the agent process")
