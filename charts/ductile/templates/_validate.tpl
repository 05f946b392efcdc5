{{/*
Rules that span several values, which values.schema.json cannot express.
Each failure names the keys involved and what to change; validate.yaml
includes this, so every install, upgrade and template run checks it.
*/}}
{{- define "ductile.validate" -}}
{{- $job := .Values.job }}
{{- $w := .Values.workers }}
{{- if gt (int $job.minNodes) (int $job.maxNodes) }}
{{- fail (printf "job.minNodes (%d) must not exceed job.maxNodes (%d)" (int $job.minNodes) (int $job.maxNodes)) }}
{{- end }}
{{- if lt (int $w.replicas) (int $job.minNodes) }}
{{- fail (printf "workers.replicas (%d) must be at least job.minNodes (%d): the job could never start" (int $w.replicas) (int $job.minNodes)) }}
{{- end }}
{{- if gt (int $w.replicas) (int $job.maxNodes) }}
{{- fail (printf "workers.replicas (%d) must not exceed job.maxNodes (%d): raise job.maxNodes to scale further" (int $w.replicas) (int $job.maxNodes)) }}
{{- end }}
{{- if and (not $job.name) (not (regexMatch "^[a-z0-9][a-z0-9-]{0,62}$" .Release.Name)) }}
{{- fail (printf "release name %q is not a valid job id ([a-z0-9][a-z0-9-]{0,62}): set job.name" .Release.Name) }}
{{- end }}
{{- $rdzvId := include "ductile.rdzvId" . }}
{{- if gt (len $rdzvId) 63 }}
{{- fail (printf "job.name: the rendezvous id %q (<namespace>-<job.name or release name>) is %d characters, more than 63: choose a shorter job.name" $rdzvId (len $rdzvId)) }}
{{- end }}
{{- if and $job.nprocPerNode (gt (int $w.gpusPerNode) 0) (gt (int $job.nprocPerNode) (int $w.gpusPerNode)) }}
{{- fail (printf "job.nprocPerNode (%d) must not exceed workers.gpusPerNode (%d): one trainer process per GPU" (int $job.nprocPerNode) (int $w.gpusPerNode)) }}
{{- end }}
{{- if $w.terminationGracePeriodSeconds }}
{{- if le (int $w.terminationGracePeriodSeconds) (int $job.shutdownTimeout) }}
{{- fail (printf "workers.terminationGracePeriodSeconds (%d) must be above job.shutdownTimeout (%d), or the agent is killed before it leaves the job cleanly" (int $w.terminationGracePeriodSeconds) (int $job.shutdownTimeout)) }}
{{- end }}
{{- end }}
{{- range $k := list "requests" "limits" }}
{{- $r := get (default dict $w.resources) $k }}
{{- if and $r (hasKey $r $w.gpuResourceName) }}
{{- fail (printf "workers.resources.%s.%s: set GPUs with workers.gpusPerNode instead" $k $w.gpuResourceName) }}
{{- end }}
{{- end }}
{{- $ext := .Values.etcd.external }}
{{- $tls := .Values.etcd.tls }}
{{- $auth := .Values.etcd.auth }}
{{- if and $auth.secretName (not $auth.enabled) }}
{{- fail (printf "etcd.auth.secretName %q is set but etcd.auth.enabled is false: set etcd.auth.enabled=true to require the root user's password" $auth.secretName) }}
{{- end }}
{{- if and $auth.enabled (not .Values.etcd.enabled) }}
{{- fail "etcd.auth.enabled is true but etcd.enabled is false: it configures the chart's own etcd; for an existing one set etcd.external.auth.secretName" }}
{{- end }}
{{- if and $tls.secretName (not $tls.enabled) }}
{{- fail (printf "etcd.tls.secretName %q is set but etcd.tls.enabled is false: set etcd.tls.enabled=true to serve etcd over TLS" $tls.secretName) }}
{{- end }}
{{- if .Values.etcd.enabled }}
{{- if or $ext.endpoints $ext.tls.secretName $ext.auth.secretName }}
{{- fail "etcd.external.* is set but etcd.enabled is true: set etcd.enabled=false to use an existing etcd" }}
{{- end }}
{{- /* A given Secret must exist (checked against a cluster only: offline,
lookup finds nothing, not even kube-system). */}}
{{- if and $tls.enabled $tls.secretName (lookup "v1" "Namespace" "" "kube-system") }}
{{- $given := lookup "v1" "Secret" .Release.Namespace $tls.secretName }}
{{- if not $given }}
{{- fail (printf "etcd.tls.secretName: Secret %q not found in namespace %s: create it (ca.crt, tls.crt, tls.key) or leave etcd.tls.secretName empty to have the chart make one" $tls.secretName .Release.Namespace) }}
{{- end }}
{{- range $k := list "ca.crt" "tls.crt" "tls.key" }}
{{- if not (hasKey (default dict $given.data) $k) }}
{{- fail (printf "etcd.tls.secretName: Secret %q has no key %s (it needs ca.crt, tls.crt and tls.key)" $tls.secretName $k) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and $auth.enabled $auth.secretName (lookup "v1" "Namespace" "" "kube-system") }}
{{- $given := lookup "v1" "Secret" .Release.Namespace $auth.secretName }}
{{- if not (hasKey (default dict (get (default dict $given) "data")) "password") }}
{{- fail (printf "etcd.auth.secretName: Secret %q in namespace %s is missing or has no key password: create it, or leave etcd.auth.secretName empty to have the chart make one" $auth.secretName .Release.Namespace) }}
{{- end }}
{{- end }}
{{- else }}
{{- if $tls.enabled }}
{{- fail "etcd.tls.enabled is true but etcd.enabled is false: it configures the chart's own etcd; for an existing one set etcd.external.tls.secretName" }}
{{- end }}
{{- if not $ext.endpoints }}
{{- fail "etcd.enabled is false but etcd.external.endpoints is empty: give the client URLs of an existing etcd" }}
{{- end }}
{{- range $ext.endpoints }}
{{- if and $ext.tls.secretName (not (hasPrefix "https://" .)) }}
{{- fail (printf "etcd.external.endpoints: %q must be https:// when etcd.external.tls.secretName is set" .) }}
{{- end }}
{{- if and (not $ext.tls.secretName) (hasPrefix "https://" .) }}
{{- fail (printf "etcd.external.endpoints: %q is https:// but etcd.external.tls.secretName is empty: give the Secret with the CA and client certificate" .) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.checkpoint.existingClaim .Values.checkpoint.perPod }}
{{- fail "checkpoint.existingClaim and checkpoint.perPod are exclusive: one shared claim, or one volume per pod" }}
{{- end }}
{{- $pdb := .Values.podDisruptionBudget }}
{{- if and $pdb.enabled (not (kindIs "invalid" $pdb.minAvailable)) (not (kindIs "invalid" $pdb.maxUnavailable)) }}
{{- fail "podDisruptionBudget: set minAvailable or maxUnavailable, not both" }}
{{- end }}
{{- $kind := include "ductile.workersKind" . }}
{{- if not (kindIs "map" $w.job) }}
{{- if eq $kind "job" }}
{{- fail "workers.kind is job but workers.job is missing: this release's values predate workers.kind (helm upgrade --reuse-values keeps them); upgrade with --reset-then-reuse-values, or give the job file again" }}
{{- end }}
{{- else if eq $kind "job" }}
{{- include "ductile.validateJob" . }}
{{- else }}
{{- range $k := list "backoffLimitPerIndex" "ttlSecondsAfterFinished" "activeDeadlineSeconds" }}
{{- if not (kindIs "invalid" (index $w.job $k)) }}
{{- fail (printf "workers.job.%s is set but workers.kind is %s: it applies to workers.kind=job only" $k $kind) }}
{{- end }}
{{- end }}
{{- end }}
{{- include "ductile.validatePod" . }}
{{- if and .Values.monitoring.events.enabled (ne $kind "job") }}
{{- fail (printf "monitoring.events.enabled needs workers.kind=job: the agents post Events on their Job, and workers.kind is %s" $kind) }}
{{- end }}
{{- if and $job.script.content (not (has (printf "%s/%s" $job.script.mountPath $job.script.fileName) $job.command)) }}
{{- fail (printf "job.script is set but job.command never names %s/%s: run the script from the command" $job.script.mountPath $job.script.fileName) }}
{{- end }}
{{- end }}

{{/*
Rules of the pod's extension points: a name the chart already uses, a
mount of no volume, a gang that could never be placed.
*/}}
{{- define "ductile.validatePod" -}}
{{- $w := .Values.workers }}
{{- $own := list "shm" "tmp" "checkpoints" "script" "etcd-tls" }}
{{- $extra := list }}
{{- range $i, $v := $w.extraVolumes }}
{{- if has $v.name $own }}
{{- fail (printf "workers.extraVolumes[%d]: the name %q is one of the chart's own volumes (%s): pick another" $i $v.name (join ", " $own)) }}
{{- end }}
{{- if has $v.name $extra }}
{{- fail (printf "workers.extraVolumes[%d]: the name %q is given twice" $i $v.name) }}
{{- end }}
{{- $extra = append $extra $v.name }}
{{- end }}
{{- range $i, $m := $w.extraVolumeMounts }}
{{- if not (has $m.name (concat $own $extra)) }}
{{- fail (printf "workers.extraVolumeMounts[%d]: no volume named %q: add it to workers.extraVolumes" $i $m.name) }}
{{- end }}
{{- end }}
{{- range $i, $c := $w.initContainers }}
{{- if eq $c.name "agent" }}
{{- fail (printf "workers.initContainers[%d]: the name \"agent\" is the agent container's: pick another" $i) }}
{{- end }}
{{- end }}
{{- if and $w.podGroup $w.podGroup.enabled }}
{{- $min := int (include "ductile.podGroupMinMember" .) }}
{{- if gt $min (int $w.replicas) }}
{{- fail (printf "workers.podGroup.minMember (%d) must not exceed workers.replicas (%d): the group could never be placed" $min (int $w.replicas)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Rules of workers.kind=job: what Kubernetes would refuse, or accept and then
run wrong.
*/}}
{{- define "ductile.validateJob" -}}
{{- $name := include "ductile.workerName" . }}
{{- if and .Values.checkpoint.enabled .Values.checkpoint.perPod }}
{{- fail "checkpoint.perPod needs workers.kind=statefulset: a Job cannot give each pod a volume of its own that outlives it; keep the shared checkpoint volume (the default) or set workers.kind=statefulset" }}
{{- end }}
{{- $pdb := .Values.podDisruptionBudget }}
{{- if and $pdb.enabled (not (kindIs "invalid" $pdb.maxUnavailable)) }}
{{- fail "podDisruptionBudget.maxUnavailable needs workers.kind=statefulset: for a Job's pods Kubernetes honours only an integer minAvailable (a Job has no scale subresource); set podDisruptionBudget.minAvailable instead" }}
{{- end }}
{{- if and $pdb.enabled (kindIs "string" $pdb.minAvailable) }}
{{- fail (printf "podDisruptionBudget.minAvailable %q: for a Job's pods Kubernetes honours only an integer minAvailable (a Job has no scale subresource); give a number of pods" $pdb.minAvailable) }}
{{- end }}
{{- /* An upgrade may change the Job's size and counters, never its pods:
Kubernetes would refuse the patch after the release's other objects (the
script's ConfigMap among them) were already changed. lookup finds nothing
offline (helm template, lint), so this runs only against a cluster. */}}
{{- $live := lookup "batch/v1" "Job" .Release.Namespace $name }}
{{- $was := dig "metadata" "annotations" "checksum/immutable-spec" "" $live }}
{{- if and $was (ne $was (include "ductile.jobImmutableChecksum" .)) }}
{{- fail (printf "workers.kind=job: Job %s exists, and Kubernetes lets an upgrade change only its size (workers.replicas), workers.job.backoffLimit, workers.job.ttlSecondsAfterFinished, workers.job.activeDeadlineSeconds, workers.labels and workers.annotations; these values change its pods or failure policy. Keep the rest as it is (helm upgrade --reuse-values --set workers.replicas=N), or uninstall the release and install it again (charts/ductile/README.md: Change a running job)" $name) }}
{{- end }}
{{- end }}
