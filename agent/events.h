/* events.h: Kubernetes Events on the agent's Job (events.c), opt-in
 * (--k8s-events). Membership changes and failures become core/v1 Events
 * whose involvedObject is the Job, posted from a thread of their own: the
 * loop only queues them, a few a minute at most. */
#ifndef DUCTILE_AGENT_EVENTS_H
#define DUCTILE_AGENT_EVENTS_H

#include "ductile/log.h"

#include <stddef.h>

/* At most this many Events a minute per agent (a burst of as many, then
 * one every 60/AGENT_EVENTS_PER_MIN s); the same reason and message again
 * within AGENT_EVENTS_DEDUPE_S is dropped. */
#define AGENT_EVENTS_PER_MIN 6
#define AGENT_EVENTS_DEDUPE_S 600.0

typedef struct agent_events agent_events;

/* Reads where to post from the environment (DUCTILE_K8S_API or the
 * in-cluster KUBERNETES_SERVICE_HOST/PORT, DUCTILE_K8S_TOKEN_FILE,
 * DUCTILE_K8S_CA_FILE, DUCTILE_K8S_NAMESPACE or the service account's,
 * DUCTILE_K8S_JOB_NAME, DUCTILE_K8S_JOB_UID) and starts the thread. NULL
 * and msg when the settings are incomplete. lg must outlive the handle;
 * node names the poster (the Events' source.host). */
agent_events *agent_events_start(const dlog *lg, const char *node, char *msg, size_t msglen);
/* Queues an Event (warning: type Warning, else Normal); never blocks on the
 * network. NULL e is a no-op. */
void agent_events_post(agent_events *e, int warning, const char *reason, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Posts what is queued, starting no post after AGENT_EVENTS_FLUSH_S (each
 * is bounded by its own 3 s timeout), and frees e. */
void agent_events_stop(agent_events *e);

#define AGENT_EVENTS_FLUSH_S 2.0

#endif
