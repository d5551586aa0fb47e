"""A key holder that floods one worker with step frames for chunks no step has
(tests/test_op_share_real.py):

    python tests/op_flooder.py --target HOST:PORT --key-file KEY [--chunks 64]

It proves the job's key as rank 1 on the bulk channel (which rank 1's own small steps leave
unopened, so the real rank 1 keeps its connections) and sends, for each step from
`--first-step` on, a META_BCAST_REQUEST for every chunk of a `--chunks`-chunk step that the
tree rule puts on tree 0, where rank 1 is the target's child: the sender rule and the role rule
let each through, and each names an op no step of the job will ever have. Each line on its
stdin, "FIRST STEPS", sends those of steps FIRST to FIRST + STEPS - 1, then a META_CLOSE, which
only a parent may send (the worker counts it as a foreign frame, after every frame before it on
the connection), and prints one JSON line: {"sent": N}, the flood's frames so far. It holds
the connection until its stdin closes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fttree.core.messages import Kind, Message
from fttree.core.protocol import TreeMachine
from fttree.core.view import View
from fttree.net import handshake as hs
from fttree.net.credentials import Credentials
from tests.rawpeer import connect, handshake, message_frame

ATTACKER, VICTIM, OTHER_CHILD = 1, 0, 2  # rank 0 is the root of tree 0, with children 1 and 2


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--key-file", required=True)
    ap.add_argument("--chunks", type=int, default=64)
    args = ap.parse_args()
    host, port = args.target.rsplit(":", 1)
    key = Credentials.from_key_file(args.key_file).key
    rule = TreeMachine(VICTIM, View.initial(3))  # the tree rule every member applies alike
    bogus = [c for c in range(1, args.chunks) if rule.tree_of(c, args.chunks) == 0]
    sock = connect(host, int(port))
    if not handshake(sock, ATTACKER, dst=VICTIM, key=key, channel=hs.BULK):
        print(json.dumps({"error": "the worker did not take the proof"}), flush=True)
        return 1
    sent = 0
    for line in sys.stdin:
        first, steps = (int(word) for word in line.split())
        for step in range(first, first + steps):
            sock.sendall(b"".join(message_frame(Message(kind=Kind.META_BCAST_REQUEST, src=ATTACKER, step=step,
                                                        chunk=chunk, chunks=args.chunks, tree=0, target=OTHER_CHILD))
                                  for chunk in bogus))
            sent += len(bogus)
        sock.sendall(message_frame(Message(kind=Kind.META_CLOSE, src=ATTACKER, step=first)))
        print(json.dumps({"sent": sent}), flush=True)
    sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
