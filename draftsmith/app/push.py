"""`draftsmith push CKPT REPO_ID`: publish a checkpoint with its model card (draftsmith.hub does the work)."""

from __future__ import annotations

import argparse
import os

from draftsmith.app.drafters import DRAFTERS
from draftsmith.errors import DraftsmithError
from draftsmith.hub import push_to_hub


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint or export folder to publish")
    p.add_argument("repo_id", help="Hub repository, NAMESPACE/NAME")
    p.add_argument("--private", action="store_true", help="create the repository as private")
    p.add_argument(
        "--dry-run", metavar="DIR", help="write exactly what would be uploaded into DIR; upload nothing"
    )
    p.add_argument(
        "--eval", metavar="EVAL_JSON", help="eval.json from draftsmith eval (default: found near CKPT)"
    )
    p.add_argument("--no-results", action="store_true", help="publish without measured results in the card")
    p.add_argument(
        "--token-env",
        metavar="NAME",
        help="environment variable holding the Hub token (default: HF_TOKEN / login)",
    )
    p.add_argument("--message", help="commit message")


def run(args: argparse.Namespace) -> int:
    token = None
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            raise DraftsmithError(
                f"environment variable {args.token_env} is not set; export it or drop --token-env"
            )
    where = push_to_hub(
        args.checkpoint,
        args.repo_id,
        private=args.private,
        eval_json=args.eval,
        dry_run_dir=args.dry_run,
        token=token,
        require_results=not args.no_results,
        commit_message=args.message,
        kinds=DRAFTERS,  # a native folder's tensors are checked against its kind before anything is staged
    )
    print(f"{'staged in' if args.dry_run else 'pushed:'} {where}")
    return 0
