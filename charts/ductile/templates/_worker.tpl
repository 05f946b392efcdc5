{{/*
The worker pod, shared by both kinds of workload (workers.kind): a
StatefulSet (worker-statefulset.yaml) or an Indexed Job (worker-job.yaml).
One definition, so the two kinds cannot drift apart; the few differences
(restartPolicy, subdomain, labels) are marked where they are.

Every pod runs ductile-agent, which joins the rendezvous in etcd and starts
the job's command once per local rank. Its node id is the pod's name and
its address the pod's IP:

- A Job's pod is named <job>-<index>-<random>: it carries the completion
  index and is unique per pod. A node id of the index alone would make a
  replacement pod, started while the lease of the pod it replaces still
  runs (a pod killed without SIGTERM keeps it up to job.leaseTTL), be
  refused as a duplicate: exit 1, which the Job counts as a failure.
  Nothing is lost by a new id: a replacement joins the next round as a
  newcomer either way (its lease is new). A StatefulSet's pod keeps its
  name, <name>-<ordinal>; there a refused agent is simply restarted in
  place, with the kubelet's back-off, until the old lease has ended.
- The IP is what peers connect to (MASTER_ADDR, the trainer's TCP ring):
  it needs no DNS lookup and cannot be stale, whereas a replaced index keeps
  its DNS name while its IP changes, and the record appears only once the
  pod is in the Service's endpoints.
*/}}

{{/* Labels of a worker pod. A Job's pod template is immutable: its pods
carry no label that changes with the chart's version, so an upgrade of the
chart alone does not make the Job unchangeable (see worker-job.yaml). */}}
{{- define "ductile.workerPodLabels" -}}
{{- if eq (include "ductile.workersKind" .) "job" }}
{{- include "ductile.selectorLabels" (dict "ctx" . "component" "worker") }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ductile
{{- else }}
{{- include "ductile.labels" (dict "ctx" . "component" "worker") }}
{{- end }}
{{- end }}

{{/* The pod template (metadata and spec) of the workers. */}}
{{- define "ductile.workerPodTemplate" -}}
{{- $w := .Values.workers -}}
{{- $ckpt := .Values.checkpoint -}}
metadata:
  labels:
    {{- include "ductile.workerPodLabels" . | nindent 4 }}
    {{- with $w.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- if and $w.podGroup $w.podGroup.enabled }}
    scheduling.x-k8s.io/pod-group: {{ include "ductile.workerName" . }}
    {{- end }}
  {{- if or .Values.job.script.content $w.podAnnotations }}
  annotations:
    {{- if .Values.job.script.content }}
    checksum/script: {{ .Values.job.script.content | sha256sum }}
    {{- end }}
    {{- with $w.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
spec:
  {{- if eq (include "ductile.workersKind" .) "job" }}
  # The Job controller, not the kubelet, replaces a pod that ended, as its
  # podFailurePolicy says (which requires Never).
  restartPolicy: Never
  # The pod's host name is <job>-<index>; this gives it the DNS name
  # <job>-<index>.<service>.<namespace>.svc in the workers' headless Service.
  subdomain: {{ include "ductile.workerName" . }}
  {{- end }}
  serviceAccountName: {{ include "ductile.serviceAccountName" . }}
  # The agent needs the API only to post Events (monitoring.events).
  automountServiceAccountToken: {{ .Values.monitoring.events.enabled }}
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ include "ductile.gracePeriod" . }}
  {{- if $w.hostNetwork }}
  hostNetwork: true
  dnsPolicy: ClusterFirstWithHostNet
  {{- end }}
  securityContext:
    {{- include "ductile.podSecurityContext" $w.podSecurityContext | nindent 4 }}
  {{- with .Values.image.pullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . }}
    {{- end }}
  {{- end }}
  {{- with $w.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $w.schedulerName }}
  schedulerName: {{ . }}
  {{- end }}
  {{- with $w.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with $w.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $w.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $w.affinity }}
  {{- /* A template: a selector of the release's own pods names them with
  "{{ .Release.Name }}", never a copy of one release's name. */}}
  affinity:
    {{- tpl (toYaml .) $ | nindent 4 }}
  {{- end }}
  {{- with $w.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $w.initContainers }}
  initContainers:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: agent
      image: {{ include "ductile.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command:
        - ductile-agent
      args:
        - "--"
        {{- range .Values.job.command }}
        - {{ . | quote }}
        {{- end }}
      env:
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        - name: POD_NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        {{- if .Values.monitoring.events.enabled }}
        # Events on the Job (the agent's --k8s-events); the API server and
        # token are the in-cluster ones.
        - name: DUCTILE_K8S_EVENTS
          value: "true"
        - name: DUCTILE_K8S_NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
        - name: DUCTILE_K8S_JOB_NAME
          value: {{ include "ductile.workerName" . | quote }}
        - name: DUCTILE_K8S_JOB_UID
          valueFrom:
            fieldRef:
              fieldPath: metadata.labels['batch.kubernetes.io/controller-uid']
        {{- end }}
        - name: DUCTILE_NODE_ID
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        - name: DUCTILE_NODE_ADDR
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        # ductile-train's TCP ring listens on and publishes this address
        # (its --host; the default, 127.0.0.1, only works within a pod).
        - name: DUCTILE_TRAIN_HOST
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        {{- include "ductile.etcdClientEnv" . | nindent 8 }}
        - name: DUCTILE_NNODES
          value: "{{ .Values.job.minNodes }}:{{ .Values.job.maxNodes }}"
        - name: DUCTILE_NPROC_PER_NODE
          value: {{ include "ductile.nprocPerNode" . | quote }}
        - name: DUCTILE_MAX_RESTARTS
          value: {{ .Values.job.maxRestarts | quote }}
        - name: DUCTILE_REBUILD
          value: {{ .Values.job.rebuild | quote }}
        - name: DUCTILE_LEASE_TTL
          value: {{ .Values.job.leaseTTL | quote }}
        - name: DUCTILE_LAST_CALL
          value: {{ .Values.job.lastCall | quote }}
        - name: DUCTILE_JOIN_TIMEOUT
          value: {{ .Values.job.joinTimeout | quote }}
        - name: DUCTILE_SHUTDOWN_TIMEOUT
          value: {{ .Values.job.shutdownTimeout | quote }}
        - name: DUCTILE_STOP_GRACE
          value: {{ .Values.job.stopGrace | quote }}
        - name: DUCTILE_HTTP_PORT
          value: {{ $w.httpPort | quote }}
        - name: DUCTILE_LOG_FORMAT
          value: {{ .Values.job.logFormat | quote }}
        # This install's id (install-configmap.yaml): a job that ended under
        # another install's id is refused (exit 2), or with job.startOver,
        # trained again.
        - name: DUCTILE_INSTALL_ID
          valueFrom:
            configMapKeyRef:
              name: {{ include "ductile.installConfigMap" . }}
              key: id
        {{- if .Values.job.startOver }}
        - name: DUCTILE_START_OVER
          value: "true"
        {{- end }}
        {{- if eq (include "ductile.workersKind" .) "job" }}
        # A pod that leaves a running job on SIGTERM (deleted, evicted,
        # preempted) exits 5, not 0: its index is not complete, and the
        # podFailurePolicy has it replaced, uncounted.
        - name: DUCTILE_LEAVE_EXIT_CODE
          value: "5"
        {{- end }}
        {{- with .Values.nccl }}
        {{- if .socketIfname }}
        - name: NCCL_SOCKET_IFNAME
          value: {{ .socketIfname | quote }}
        {{- end }}
        {{- if not (kindIs "invalid" .ibDisable) }}
        - name: NCCL_IB_DISABLE
          value: {{ ternary "1" "0" .ibDisable | quote }}
        {{- end }}
        {{- if .ibHca }}
        - name: NCCL_IB_HCA
          value: {{ .ibHca | quote }}
        {{- end }}
        {{- if .netGdrLevel }}
        - name: NCCL_NET_GDR_LEVEL
          value: {{ .netGdrLevel | quote }}
        {{- end }}
        {{- if .debug }}
        - name: NCCL_DEBUG
          value: {{ .debug | quote }}
        {{- end }}
        {{- range $k, $v := .extraEnv }}
        - name: {{ $k }}
          value: {{ $v | quote }}
        {{- end }}
        {{- end }}
        {{- range $k, $v := .Values.job.env }}
        - name: {{ $k }}
          value: {{ $v | quote }}
        {{- end }}
        {{- with $w.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $w.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      ports:
        - name: http
          containerPort: {{ $w.httpPort }}
          protocol: TCP
      livenessProbe:
        httpGet:
          path: /healthz
          port: http
        {{- toYaml $w.livenessProbe | nindent 8 }}
      readinessProbe:
        httpGet:
          path: /readyz
          port: http
        {{- toYaml $w.readinessProbe | nindent 8 }}
      resources:
        {{- $res := deepCopy (default dict $w.resources) }}
        {{- if gt (int $w.gpusPerNode) 0 }}
        {{- $_ := set $res "requests" (merge (dict $w.gpuResourceName (int $w.gpusPerNode)) (default dict $res.requests)) }}
        {{- $_ := set $res "limits" (merge (dict $w.gpuResourceName (int $w.gpusPerNode)) (default dict $res.limits)) }}
        {{- end }}
        {{- toYaml $res | nindent 8 }}
      securityContext:
        {{- include "ductile.agentSecurityContext" . | nindent 8 }}
      volumeMounts:
        - name: shm
          mountPath: /dev/shm
        - name: tmp
          mountPath: /tmp
        - name: checkpoints
          mountPath: {{ $ckpt.mountPath }}
        {{- if .Values.job.script.content }}
        - name: script
          mountPath: {{ .Values.job.script.mountPath }}
          readOnly: true
        {{- end }}
        {{- with (include "ductile.etcdTLSVolumeMount" .) }}{{ . | nindent 8 }}{{ end }}
        {{- with $w.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $w.shmSize }}
    - name: tmp
      emptyDir: {}
    {{- if not $ckpt.enabled }}
    - name: checkpoints
      emptyDir: {}
    {{- else if $ckpt.existingClaim }}
    - name: checkpoints
      persistentVolumeClaim:
        claimName: {{ $ckpt.existingClaim }}
    {{- else if not $ckpt.perPod }}
    - name: checkpoints
      persistentVolumeClaim:
        claimName: {{ include "ductile.fullname" . }}-checkpoints
    {{- end }}
    {{- if .Values.job.script.content }}
    - name: script
      configMap:
        name: {{ include "ductile.fullname" . }}-script
        defaultMode: 0444
    {{- end }}
    {{- with (include "ductile.etcdTLSVolume" .) }}{{ . | nindent 4 }}{{ end }}
    {{- with $w.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* The agent container's securityContext: the chart's, with
workers.containerSecurityContext over it key by key. Set by hand, not with
mergeOverwrite, which skips false and 0 (runAsNonRoot: false would be
lost); capabilities' add and drop each replace the chart's list. */}}
{{- define "ductile.agentSecurityContext" -}}
{{- $w := .Values.workers -}}
{{- $sc := include "ductile.containerSecurityContext" (dict "readOnly" $w.readOnlyRootFilesystem) | fromYaml -}}
{{- range $k, $v := (default dict $w.containerSecurityContext) }}
{{- if and (eq $k "capabilities") (kindIs "map" $v) }}
{{- $caps := deepCopy (default dict (get $sc "capabilities")) }}
{{- range $ck, $cv := $v }}
{{- $_ := set $caps $ck $cv }}
{{- end }}
{{- $_ := set $sc "capabilities" $caps }}
{{- else }}
{{- $_ := set $sc $k $v }}
{{- end }}
{{- end }}
{{- toYaml $sc }}
{{- end }}

{{/* The fields of the Indexed Job that Kubernetes never lets change (the
pod template aside); worker-job.yaml explains the rules. */}}
{{- define "ductile.jobImmutableSpec" -}}
{{- $j := default dict .Values.workers.job -}}
completionMode: Indexed
{{- if not (kindIs "invalid" $j.backoffLimitPerIndex) }}
backoffLimitPerIndex: {{ $j.backoffLimitPerIndex }}
maxFailedIndexes: 0
{{- end }}
podReplacementPolicy: Failed
podFailurePolicy:
  rules:
    - action: FailJob
      onExitCodes:
        containerName: agent
        operator: In
        values: [2, 3]
    - action: Ignore
      onPodConditions:
        - type: DisruptionTarget
          status: "True"
    - action: Ignore
      onExitCodes:
        containerName: agent
        operator: In
        values: [4, 5, 6]
{{- end }}

{{/* Checksum of everything Kubernetes keeps immutable in the Job. */}}
{{- define "ductile.jobImmutableChecksum" -}}
{{- printf "%s\n%s" (include "ductile.jobImmutableSpec" .) (include "ductile.workerPodTemplate" .) | sha256sum }}
{{- end }}
