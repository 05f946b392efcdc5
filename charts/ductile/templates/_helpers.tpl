{{/*
Names, labels and the values every template shares.

Object names are kept short enough that a worker pod's name
(<fullname>-worker-<ordinal>) stays a valid 63-character host name.
*/}}

{{- define "ductile.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "ductile.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "ductile.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object; pass (dict "ctx" $ "component" "worker"). */}}
{{- define "ductile.labels" -}}
helm.sh/chart: {{ include "ductile.chart" .ctx }}
{{ include "ductile.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: ductile
{{- end }}

{{/* Labels a selector matches: name, instance and component. */}}
{{- define "ductile.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ductile.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* workers.kind. A release installed before workers.kind existed and
upgraded with --reuse-values keeps its old chart's values, which lack it:
such a release has a StatefulSet, and keeps it. */}}
{{- define "ductile.workersKind" -}}
{{- .Values.workers.kind | default "statefulset" }}
{{- end }}

{{- define "ductile.workerName" -}}
{{- printf "%s-worker" (include "ductile.fullname" .) }}
{{- end }}

{{- define "ductile.etcdName" -}}
{{- printf "%s-etcd" (include "ductile.fullname" .) }}
{{- end }}

{{- define "ductile.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ductile.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The job's name: job.name, else the release name. */}}
{{- define "ductile.jobName" -}}
{{- default .Release.Name .Values.job.name }}
{{- end }}

{{/* The rendezvous id (--rdzv-id, the job's key prefix /ductile/<id>/ in
etcd): <namespace>-<job name>, so that releases of one job name in two
namespaces never share keys on one etcd. */}}
{{- define "ductile.rdzvId" -}}
{{- printf "%s-%s" .Release.Namespace (include "ductile.jobName" .) }}
{{- end }}

{{/* The ConfigMap that holds the install id (install-configmap.yaml). */}}
{{- define "ductile.installConfigMap" -}}
{{- printf "%s-install" (include "ductile.fullname" .) }}
{{- end }}

{{/* The install id that the ConfigMap found by lookup (the argument; an
empty map when there is none) holds, else a new one. */}}
{{- define "ductile.installIdOf" -}}
{{- dig "data" "id" (randAlphaNum 12 | lower) (default dict .) }}
{{- end }}

{{- define "ductile.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Trainer processes per node: job.nprocPerNode, else one per GPU, else 1. */}}
{{- define "ductile.nprocPerNode" -}}
{{- if .Values.job.nprocPerNode }}
{{- .Values.job.nprocPerNode }}
{{- else if gt (int .Values.workers.gpusPerNode) 0 }}
{{- .Values.workers.gpusPerNode }}
{{- else }}
{{- 1 }}
{{- end }}
{{- end }}

{{/* The PodGroup's minMember: workers.podGroup.minMember, else job.minNodes. */}}
{{- define "ductile.podGroupMinMember" -}}
{{- if not (kindIs "invalid" .Values.workers.podGroup.minMember) }}
{{- .Values.workers.podGroup.minMember }}
{{- else }}
{{- .Values.job.minNodes }}
{{- end }}
{{- end }}

{{- define "ductile.gracePeriod" -}}
{{- if .Values.workers.terminationGracePeriodSeconds }}
{{- .Values.workers.terminationGracePeriodSeconds }}
{{- else }}
{{- add .Values.job.shutdownTimeout 10 }}
{{- end }}
{{- end }}

{{/* Stable host name of etcd member i: <pod>.<peer service>.<ns>.svc.<domain>. */}}
{{- define "ductile.etcdMemberHost" -}}
{{- $name := include "ductile.etcdName" .ctx }}
{{- printf "%s-%d.%s-peer.%s.svc.%s" $name (int .index) $name .ctx.Release.Namespace .ctx.Values.clusterDomain }}
{{- end }}

{{/* The agents' --rdzv-endpoint: every member's client URL, comma-separated. */}}
{{- define "ductile.etcdEndpoints" -}}
{{- if .Values.etcd.enabled }}
{{- $urls := list }}
{{- range $i := until (int .Values.etcd.replicas) }}
{{- $urls = append $urls (printf "%s://%s:2379" (ternary "https" "http" $.Values.etcd.tls.enabled) (include "ductile.etcdMemberHost" (dict "ctx" $ "index" $i))) }}
{{- end }}
{{- join "," $urls }}
{{- else }}
{{- join "," .Values.etcd.external.endpoints }}
{{- end }}
{{- end }}

{{/* etcd client settings (endpoints, TLS files, auth) as container env. */}}
{{- define "ductile.etcdClientEnv" -}}
- name: DUCTILE_RDZV_ENDPOINT
  value: {{ include "ductile.etcdEndpoints" . | quote }}
- name: DUCTILE_RDZV_ID
  value: {{ include "ductile.rdzvId" . | quote }}
{{- $tls := include "ductile.etcdTLSKeys" . | fromYaml }}
{{- if $tls.secret }}
- name: DUCTILE_ETCD_CACERT
  value: /etc/ductile/etcd-tls/{{ $tls.ca }}
- name: DUCTILE_ETCD_CERT
  value: /etc/ductile/etcd-tls/{{ $tls.cert }}
- name: DUCTILE_ETCD_KEY
  value: /etc/ductile/etcd-tls/{{ $tls.key }}
{{- end }}
{{- if and (not .Values.etcd.enabled) .Values.etcd.external.auth.secretName }}
- name: DUCTILE_ETCD_USER
  valueFrom:
    secretKeyRef:
      name: {{ .Values.etcd.external.auth.secretName }}
      key: {{ .Values.etcd.external.auth.usernameKey }}
- name: DUCTILE_ETCD_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.etcd.external.auth.secretName }}
      key: {{ .Values.etcd.external.auth.passwordKey }}
{{- else if and .Values.etcd.enabled .Values.etcd.auth.enabled }}
- name: DUCTILE_ETCD_USER
  value: root
- name: DUCTILE_ETCD_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "ductile.etcdAuthSecret" . }}
      key: password
{{- end }}
{{- end }}

{{/* The Secret with the etcd client's CA, certificate and key, and their
keys in it, as YAML (secret empty: no TLS): the chart's own etcd's
(etcd.tls) or an existing etcd's (etcd.external.tls). */}}
{{- define "ductile.etcdTLSKeys" -}}
{{- if .Values.etcd.enabled }}
{{- if .Values.etcd.tls.enabled }}
secret: {{ include "ductile.etcdTLSSecret" . }}
ca: ca.crt
cert: tls.crt
key: tls.key
{{- end }}
{{- else if .Values.etcd.external.tls.secretName }}
{{- $t := .Values.etcd.external.tls }}
secret: {{ $t.secretName }}
ca: {{ $t.caKey }}
cert: {{ $t.certKey }}
key: {{ $t.keyKey }}
{{- end }}
{{- end }}

{{/* The Secret of the root user's password of the chart's own etcd: given,
or made by the chart. */}}
{{- define "ductile.etcdAuthSecret" -}}
{{- default (printf "%s-auth" (include "ductile.etcdName" .)) .Values.etcd.auth.secretName }}
{{- end }}

{{/* The Secret of the chart's own etcd's certificates: given, or made by the chart. */}}
{{- define "ductile.etcdTLSSecret" -}}
{{- default (printf "%s-tls" (include "ductile.etcdName" .)) .Values.etcd.tls.secretName }}
{{- end }}

{{- define "ductile.etcdTLSVolumeMount" -}}
{{- if (include "ductile.etcdTLSKeys" . | fromYaml).secret }}
- name: etcd-tls
  mountPath: /etc/ductile/etcd-tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "ductile.etcdTLSVolume" -}}
{{- with (include "ductile.etcdTLSKeys" . | fromYaml).secret }}
- name: etcd-tls
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{/* Container securityContext shared by every container of the chart. */}}
{{- define "ductile.containerSecurityContext" -}}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: {{ .readOnly }}
runAsNonRoot: true
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "ductile.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .runAsUser }}
runAsGroup: {{ .runAsGroup }}
fsGroup: {{ .fsGroup }}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The pod of a one-shot etcd tool (the `helm test` pod, the pre-install
check): never restarted, no API token, the workers' security context. */}}
{{- define "ductile.etcdToolPodSpec" -}}
restartPolicy: Never
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  {{- include "ductile.podSecurityContext" .Values.workers.podSecurityContext | nindent 2 }}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- with (include "ductile.etcdTLSVolume" .) }}
volumes:
  {{- . | trim | nindent 2 }}
{{- end }}
{{- end }}

{{/* The rest of a one-shot etcd tool's container: the workers' etcd client
settings (endpoints, id, TLS files, credentials), small resources. */}}
{{- define "ductile.etcdToolContainer" -}}
env:
  {{- include "ductile.etcdClientEnv" . | nindent 2 }}
resources:
  requests:
    cpu: 50m
    memory: 64Mi
  limits:
    memory: 128Mi
securityContext:
  {{- include "ductile.containerSecurityContext" (dict "readOnly" true) | nindent 2 }}
{{- with (include "ductile.etcdTLSVolumeMount" .) }}
volumeMounts:
  {{- . | trim | nindent 2 }}
{{- end }}
{{- end }}

{{/* etcdctl of the etcd image against the chart's own etcd (its endpoints
and TLS files in ETCDCTL_* variables, the root password in
ETCD_ROOT_PASSWORD); the caller adds the name and args. */}}
{{- define "ductile.etcdctlContainer" -}}
image: "{{ .Values.etcd.image.repository }}:{{ .Values.etcd.image.tag }}"
imagePullPolicy: {{ .Values.etcd.image.pullPolicy }}
command: [/usr/local/bin/etcdctl]
env:
  - name: ETCDCTL_API
    value: "3"
  - name: ETCDCTL_ENDPOINTS
    value: {{ include "ductile.etcdEndpoints" . | quote }}
  {{- with (include "ductile.etcdTLSKeys" . | fromYaml) }}
  {{- if .secret }}
  - name: ETCDCTL_CACERT
    value: /etc/ductile/etcd-tls/{{ .ca }}
  - name: ETCDCTL_CERT
    value: /etc/ductile/etcd-tls/{{ .cert }}
  - name: ETCDCTL_KEY
    value: /etc/ductile/etcd-tls/{{ .key }}
  {{- end }}
  {{- end }}
  - name: ETCD_ROOT_PASSWORD
    valueFrom:
      secretKeyRef:
        name: {{ include "ductile.etcdAuthSecret" . }}
        key: password
resources:
  requests:
    cpu: 50m
    memory: 64Mi
  limits:
    memory: 128Mi
securityContext:
  {{- include "ductile.containerSecurityContext" (dict "readOnly" true) | nindent 2 }}
{{- with (include "ductile.etcdTLSVolumeMount" .) }}
volumeMounts:
  {{- . | trim | nindent 2 }}
{{- end }}
{{- end }}
