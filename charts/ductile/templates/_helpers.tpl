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

{{/* The rendezvous id: job.name, else the release name. */}}
{{- define "ductile.jobName" -}}
{{- default .Release.Name .Values.job.name }}
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
{{- $urls = append $urls (printf "http://%s:2379" (include "ductile.etcdMemberHost" (dict "ctx" $ "index" $i))) }}
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
  value: {{ include "ductile.jobName" . | quote }}
{{- if and (not .Values.etcd.enabled) .Values.etcd.external.tls.secretName }}
- name: DUCTILE_ETCD_CACERT
  value: /etc/ductile/etcd-tls/{{ .Values.etcd.external.tls.caKey }}
- name: DUCTILE_ETCD_CERT
  value: /etc/ductile/etcd-tls/{{ .Values.etcd.external.tls.certKey }}
- name: DUCTILE_ETCD_KEY
  value: /etc/ductile/etcd-tls/{{ .Values.etcd.external.tls.keyKey }}
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
{{- end }}
{{- end }}

{{- define "ductile.etcdTLSVolumeMount" -}}
{{- if and (not .Values.etcd.enabled) .Values.etcd.external.tls.secretName }}
- name: etcd-tls
  mountPath: /etc/ductile/etcd-tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "ductile.etcdTLSVolume" -}}
{{- if and (not .Values.etcd.enabled) .Values.etcd.external.tls.secretName }}
- name: etcd-tls
  secret:
    secretName: {{ .Values.etcd.external.tls.secretName }}
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
