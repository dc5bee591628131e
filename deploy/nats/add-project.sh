#!/usr/bin/env bash
# Prints the NATS user entry of a producer for one project, to paste into the `users` list of
# shotfleet-account.conf (then `nats-server --signal reload`):
#
#   deploy/nats/add-project.sh acme               # user producer-acme, password from the server's
#                                                 # environment: SHOTFLEET_PRODUCER_PASSWORD_ACME
#   deploy/nats/add-project.sh acme UD6...X4Q     # an NKey user instead (`nk -gen user -pubout`):
#                                                 # the server keeps only the public key
#
# The producer may publish jobs of this project only, read this project's results and failed
# records (for `submit --wait`), read stream and consumer info (`status`), follow its progress
# events, cancel its jobs and ping the workers (their state, no job of another project); nothing
# else of $JS.API. Its client sets the inbox prefix
# _INBOX_producer-<project> (--inbox-prefix, NATS_INBOX_PREFIX): it may not read other inboxes.
set -euo pipefail
project="${1:?usage: add-project.sh PROJECT [NKEY_PUBLIC_KEY]}"
nkey="${2:-}"
if ! [[ "$project" =~ ^[A-Za-z0-9_-]+$ ]]; then
    echo "add-project.sh: project \`$project\` must be one subject token: letters, digits, - and _" >&2
    exit 2
fi
if [ -n "$nkey" ]; then
    if ! [[ "$nkey" =~ ^U[A-Z2-7]{55}$ ]]; then
        echo "add-project.sh: \`$nkey\` is not an NKey user public key (U followed by 55 characters)" >&2
        exit 2
    fi
    who="nkey: $nkey"
else
    variable="SHOTFLEET_PRODUCER_PASSWORD_$(echo "$project" | tr 'a-z-' 'A-Z_')"
    who="user: producer-$project, password: \$$variable"
fi
inbox="_INBOX_producer-$project"
cat <<ENTRY
      # producer of project $project (deploy/nats/add-project.sh $project)
      { $who, permissions: {
          publish: { allow: [
            "shots.p0.*.$project", "shots.p1.*.$project", "shots.p2.*.$project", "shots.cancel.$project.>", "shots.workers.ping",
            "\$JS.API.STREAM.INFO.SHOTS", "\$JS.API.STREAM.INFO.SHOT_RESULTS", "\$JS.API.STREAM.INFO.SHOTS_FAILED",
            "\$JS.API.CONSUMER.INFO.SHOTS.*",
            "\$JS.API.CONSUMER.CREATE.SHOT_RESULTS.*.shots.done.$project.*",
            "\$JS.API.CONSUMER.CREATE.SHOTS_FAILED.*.shots.failed.*.$project",
            "\$JS.API.DIRECT.GET.SHOT_RESULTS.shots.done.$project.>",
            "\$JS.FC.SHOT_RESULTS.>", "\$JS.FC.SHOTS_FAILED.>"
          ] }
          subscribe: { allow: ["$inbox.>", "shots.progress.$project.>"] }
      } }
ENTRY
