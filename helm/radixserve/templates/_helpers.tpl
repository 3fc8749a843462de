{{/*
Names. Pod names are <fullname>-worker-<unit>-<rank>, so fullname is kept short
enough for a 63-character hostname.
*/}}
{{- define "radixserve.name" -}}
{{- .Chart.Name | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "radixserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "radixserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "radixserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "radixserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "radixserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: radixserve
{{- end }}

{{/* Selector of one component (scheduler, worker, gateway, test) of one unit.
     Call with (dict "root" $ "component" "worker" "unit" 0); unit is optional. */}}
{{- define "radixserve.componentSelector" -}}
{{ include "radixserve.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- if hasKey . "unit" }}
radixserve.io/unit: {{ .unit | quote }}
{{- end }}
{{- with .mode }}
radixserve.io/disaggregation-mode: {{ . }}
{{- end }}
{{- end }}

{{- define "radixserve.componentLabels" -}}
{{ include "radixserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- if hasKey . "unit" }}
radixserve.io/unit: {{ .unit | quote }}
{{- end }}
{{- with .mode }}
radixserve.io/disaggregation-mode: {{ . }}
{{- end }}
{{- end }}

{{/* The units, as a JSON list of {id, mode}: "0".."N-1" with mode "" (one
     co-located unit per `replicas`), or with disaggregation on, "p0".. with
     mode prefill and "d0".. with mode decode. The id names the unit's objects
     (<fullname>-scheduler-<id>, <fullname>-worker-<id>) and is its
     radixserve.io/unit label. Fails on the combinations PD refuses. */}}
{{- define "radixserve.units" -}}
{{- $units := list }}
{{- with .Values.disaggregation }}
{{- if .enabled }}
{{- if not $.Values.gateway.enabled }}
{{- fail "disaggregation.enabled needs gateway.enabled: the SMG gateway pairs a prefill and a decode unit for each request and tells the decode unit where to meet the prefill one (no client of the schedulers' own API does)" }}
{{- end }}
{{- if include "radixserve.loraEnabled" $ }}
{{- fail "disaggregation.enabled cannot be combined with LoRA (lora.adapters, lora.volume): the schedulers refuse adapters in a disaggregated unit" }}
{{- end }}
{{- if $.Values.hicache.enabled }}
{{- fail "disaggregation.enabled cannot be combined with hicache.enabled: the schedulers refuse the host KV tier in a disaggregated unit" }}
{{- end }}
{{- if $.Values.tls.workers.enabled }}
{{- fail "disaggregation.enabled cannot be combined with tls.workers.enabled: prefill workers push KV to decode workers (Worker.PushKv) over plaintext gRPC; secure it with workerToken and networkPolicy instead" }}
{{- end }}
{{- range $i := until (int .prefill.replicas) }}
{{- $units = append $units (dict "id" (printf "p%d" $i) "mode" "prefill") }}
{{- end }}
{{- range $i := until (int .decode.replicas) }}
{{- $units = append $units (dict "id" (printf "d%d" $i) "mode" "decode") }}
{{- end }}
{{- end }}
{{- end }}
{{- if not .Values.disaggregation.enabled }}
{{- range $i := until (int .Values.replicas) }}
{{- $units = append $units (dict "id" (toString $i) "mode" "") }}
{{- end }}
{{- end }}
{{- toJson $units }}
{{- end }}

{{- define "radixserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "radixserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Images: <repository>:<appVersion>-<cpu|cuda> unless a tag is given. */}}
{{- define "radixserve.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.device) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{- define "radixserve.gatewayImage" -}}
{{- $repo := .Values.gateway.image.repository | default .Values.image.repository }}
{{- $tag := .Values.gateway.image.tag | default (printf "%s-cpu" .Chart.AppVersion) }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{/* DNS names. (dict "root" $ "unit" u "rank" r); u: a unit's id. */}}
{{- define "radixserve.workerService" -}}
{{- printf "%s-worker-%v" (include "radixserve.fullname" .root) .unit }}
{{- end }}

{{- define "radixserve.workerHost" -}}
{{- $svc := include "radixserve.workerService" . }}
{{- printf "%s-%d.%s.%s.svc.%s" $svc (int .rank) $svc .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{- define "radixserve.schedulerService" -}}
{{- printf "%s-scheduler-%v" (include "radixserve.fullname" .root) .unit }}
{{- end }}

{{- define "radixserve.schedulerHost" -}}
{{- printf "%s.%s.svc.%s" (include "radixserve.schedulerService" .) .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{/* The worker's --model: the image's built-in model or a path below /models. */}}
{{- define "radixserve.modelArg" -}}
{{- if eq .Values.model.source "builtin" }}
{{- "default" }}
{{- else if .Values.model.path }}
{{- printf "/models/%s" (trimPrefix "/" .Values.model.path) }}
{{- else }}
{{- "/models" }}
{{- end }}
{{- end }}

{{- define "radixserve.smgLogLevel" -}}
{{- $l := lower .Values.logging.level }}
{{- if eq $l "warning" }}warn{{ else if eq $l "critical" }}error{{ else }}{{ $l }}{{ end }}
{{- end }}

{{/* Where secrets are mounted, shared by flags and volume mounts. */}}
{{- define "radixserve.tlsDir" -}}/etc/radixserve/tls{{- end }}
{{- define "radixserve.workerTlsDir" -}}/etc/radixserve/worker-tls{{- end }}
{{- define "radixserve.apiKeyDir" -}}/etc/radixserve/api-keys{{- end }}
{{- define "radixserve.workerTokenDir" -}}/etc/radixserve/worker-token{{- end }}

{{/* Pod-level settings shared by every pod of the chart. */}}
{{- define "radixserve.podCommon" -}}
serviceAccountName: {{ include "radixserve.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/* Checksum of the settings, so a changed ConfigMap rolls the pods. */}}
{{- define "radixserve.configChecksum" -}}
{{- include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end }}

{{/* Environment every radixserve container gets besides the ConfigMap: a
     writable HOME (the root filesystem is read-only) and the pod's identity
     as OpenTelemetry resource attributes. */}}
{{- define "radixserve.commonEnv" -}}
- name: HOME
  value: /tmp
- name: K8S_POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: K8S_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.pod.name=$(K8S_POD_NAME),k8s.namespace.name=$(K8S_NAMESPACE)%s" (ternary (printf ",%s" .Values.otel.resourceAttributes) "" (ne .Values.otel.resourceAttributes "")) | quote }}
{{- end }}

{{/* LoRA: on when adapters are listed or a volume is given (else nothing of
     it renders). */}}
{{- define "radixserve.loraEnabled" -}}
{{- if or .Values.lora.adapters .Values.lora.volume }}true{{ end }}
{{- end }}

{{/* The scheduler's --lora-paths values, NAME=PATH: a relative path is below
     lora.mountPath, where the worker pods mount lora.volume. The scheduler
     sends each worker rank this same path. */}}
{{- define "radixserve.loraPaths" -}}
{{- $seen := dict }}
{{- $out := list }}
{{- $mount := trimSuffix "/" .Values.lora.mountPath }}
{{- range .Values.lora.adapters }}
{{- if hasKey $seen .name }}
{{- fail (printf "lora.adapters: the name %q is listed twice" .name) }}
{{- end }}
{{- $_ := set $seen .name true }}
{{- $path := ternary .path (printf "%s/%s" $mount (trimPrefix "./" .path)) (hasPrefix "/" .path) }}
{{- $out = append $out (printf "%s=%s" .name (trimSuffix "/" $path)) }}
{{- end }}
{{- if gt (len $out) (int .Values.lora.maxLoadedLoras) }}
{{- fail (printf "lora.adapters lists %d adapters, more than lora.maxLoadedLoras (%d) can hold loaded" (len $out) (int .Values.lora.maxLoadedLoras)) }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* Graceful drain (docs/kubernetes.md): the scheduler sleeps preStop, drains
     its streams for at most drainTimeout, then exits; its workers keep serving
     it meanwhile and a little longer; each pod's terminationGracePeriodSeconds
     covers all of it plus time to exit. */}}
{{- define "radixserve.schedulerGraceSeconds" -}}
{{- add .Values.scheduler.preStopSleepSeconds .Values.scheduler.drainTimeoutSeconds 15 }}
{{- end }}
{{- define "radixserve.workerDrainSeconds" -}}
{{- add .Values.scheduler.preStopSleepSeconds .Values.scheduler.drainTimeoutSeconds 10 }}
{{- end }}
{{- define "radixserve.workerGraceSeconds" -}}
{{- add (include "radixserve.workerDrainSeconds" . | int) 15 }}
{{- end }}

{{/* "true" when the worker pods mount the host KV tier's file volume (the
     tier on, its file tier on); fails when its path is where the LoRA
     adapters are mounted, or when the tier is on with no host pool size. */}}
{{- define "radixserve.hicacheFileTier" -}}
{{- if and .Values.hicache.enabled (le (float64 .Values.hicache.ratio) 0.0) (le (float64 .Values.hicache.sizeGiB) 0.0) }}
{{- fail "hicache.ratio must be above 0 (or hicache.sizeGiB set)" }}
{{- end }}
{{- if and .Values.hicache.enabled .Values.hicache.fileTier.enabled }}
{{- if eq (trimSuffix "/" .Values.hicache.fileTier.path) (trimSuffix "/" .Values.lora.mountPath) }}
{{- fail "hicache.fileTier.path is lora.mountPath: mount them apart" }}
{{- end }}
{{- print "true" }}
{{- end }}
{{- end }}
