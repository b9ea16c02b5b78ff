{{/* Names, labels and the pieces every pod shares. */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}{{ .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else -}}{{ printf "%s" .Release.Name | trunc 50 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "tandem.labels" -}}
app.kubernetes.io/name: tandem
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tandem.selector" -}}
app.kubernetes.io/name: tandem
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "tandem.redisUrl" -}}
{{- if .Values.redis.bundled -}}
redis://{{ if .Values.redis.auth.secretName }}:$(REDIS_PASSWORD)@{{ end }}{{ include "tandem.fullname" . }}-redis:6379/0
{{- else -}}
{{ .Values.redis.external.url }}
{{- end -}}
{{- end -}}

{{/* Environment of every Tandem container: pod IP, Redis (password from a Secret). */}}
{{- define "tandem.env" -}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
{{- $secret := .Values.redis.auth.secretName }}
{{- if not .Values.redis.bundled }}{{ $secret = .Values.redis.external.passwordSecret.name }}{{ end }}
{{- if $secret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ if .Values.redis.bundled }}{{ .Values.redis.auth.secretKey }}{{ else }}{{ .Values.redis.external.passwordSecret.key }}{{ end }}
{{- end }}
- name: TANDEM_REDIS_URL
  value: {{ include "tandem.redisUrl" . | quote }}
{{- with .Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
  value: {{ $.Values.tracing.protocol | quote }}
{{- end }}
{{- end -}}

{{/* Model weights: the image's built-in model, a PVC, a hostPath or an init container;
and, with lora.source set, the LoRA adapters' directories (a PVC or a hostPath). */}}
{{- define "tandem.modelVolume" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim: {claimName: {{ $m.pvc.claimName }}, readOnly: true}
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath: {path: {{ $m.hostPath.path }}, type: Directory}
{{- else if eq $m.source "initContainer" }}
- name: model
  emptyDir: {}
{{- end }}
{{- $l := .Values.lora -}}
{{- if and $l.enabled (eq $l.source "pvc") }}
- name: adapters
  persistentVolumeClaim: {claimName: {{ $l.pvc.claimName }}, readOnly: true}
{{- else if and $l.enabled (eq $l.source "hostPath") }}
- name: adapters
  hostPath: {path: {{ $l.hostPath.path }}, type: Directory}
{{- end }}
{{- end -}}

{{- define "tandem.modelMount" -}}
{{- if ne .Values.model.source "builtin" }}
- name: model
  mountPath: /models
  readOnly: {{ ne .Values.model.source "initContainer" }}
{{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
{{- end }}
{{- end }}
{{- if and .Values.lora.enabled (ne .Values.lora.source "none") }}
- {name: adapters, mountPath: /adapters, readOnly: true}
{{- end }}
{{- end -}}

{{/* The workers' LoRA flags (lora.*), as a JSON list of words. */}}
{{- define "tandem.loraWorkerArgs" -}}
{{- $l := .Values.lora -}}
{{- $args := list -}}
{{- if $l.enabled }}
{{- $args = list "--enable-lora" "--max-loras" (toString $l.maxLoras) "--max-lora-rank" (toString $l.maxLoraRank) }}
{{- if $l.modules }}
{{- $args = append $args "--lora-modules" }}
{{- range $l.modules }}
{{- $args = append $args (printf "%s=/adapters/%s" .name .path) }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson $args }}
{{- end -}}

{{/* The router's LoRA flags, as a JSON list of words. */}}
{{- define "tandem.loraRouterArgs" -}}
{{- if and .Values.lora.enabled .Values.lora.allowRuntimeUpdates }}
{{- toJson (list "--allow-runtime-lora-updating") }}
{{- else }}
{{- toJson list }}
{{- end }}
{{- end -}}

{{- define "tandem.modelArgs" -}}
{{- if eq .Values.model.source "builtin" -}}
--model "$(python3 -c 'from tandem.cli.serve import default_model; print(default_model())')"
{{- else -}}
--model /models/{{ .Values.model.path }}
{{- end }}
{{- if .Values.model.name }} --model-name {{ .Values.model.name }}{{ end }}
{{- end -}}

{{- define "tandem.tlsArgs" -}}
{{- if .Values.tls.enabled }} --ssl-ca-certs /tls/ca.crt --ssl-certfile /tls/tls.crt --ssl-keyfile /tls/tls.key{{ if .Values.tls.serverName }} --ssl-server-name {{ .Values.tls.serverName }}{{ end }}{{ end }}
{{- end -}}

{{- define "tandem.probes" -}}
{{ include "tandem.grpcProbes" (dict "root" . "startupSeconds" .Values.startupTimeoutSeconds) }}
{{- end -}}

{{/* gRPC health probes on the health port; the startup probe allows startupSeconds. */}}
{{- define "tandem.grpcProbes" -}}
{{- $port := .root.Values.ports.health -}}
readinessProbe:
  grpc: {port: {{ $port }}, service: ""}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  grpc: {port: {{ $port }}, service: tandem.liveness}
  periodSeconds: 10
  failureThreshold: 6
startupProbe:
  grpc: {port: {{ $port }}, service: tandem.liveness}
  periodSeconds: 5
  failureThreshold: {{ div .startupSeconds 5 }}
{{- end -}}

{{/* The planner's SLO and bounds flags (tandem/cli/planner.py add_planner_options), one
list item each: for `tandem planner` and for `tandem serve --ray --planner`. */}}
{{- define "tandem.plannerArgs" -}}
{{- $p := .Values.planner -}}
{{- range $flag, $value := dict
    "--ttft-p99" $p.ttftP99Seconds "--tpot-p99" $p.tpotP99Seconds
    "--min-prefill" $p.prefill.minReplicas "--max-prefill" $p.prefill.maxReplicas
    "--min-decode" $p.decode.minReplicas "--max-decode" $p.decode.maxReplicas
    "--planner-interval" $p.intervalSeconds "--lead-time" $p.leadTimeSeconds
    "--scale-up-cooldown" $p.scaleUpCooldownSeconds
    "--scale-down-cooldown" $p.scaleDownCooldownSeconds
    "--down-stable" $p.downStableSeconds "--max-step-up" $p.maxStepUp
    "--target-busy" $p.targetBusy "--tolerance" $p.tolerance "--surge" $p.surge }}
- {{ $flag }}
- {{ $value | toString | quote }}
{{- end }}
{{- end -}}

{{/* Bounds a template checks (JSON schema cannot compare two fields). */}}
{{- define "tandem.checks" -}}
{{- $p := .Values.planner -}}
{{- range $pool := list "prefill" "decode" }}
{{- $b := index $p $pool }}
{{- if and $p.enabled (gt (int $b.minReplicas) (int $b.maxReplicas)) }}
{{- fail (printf "planner.%s: minReplicas (%v) is above maxReplicas (%v)" $pool $b.minReplicas $b.maxReplicas) }}
{{- end }}
{{- if eq $.Values.workers.mode "kuberay" }}
{{- $g := index $.Values.kuberay $pool }}
{{- $n := index $.Values $pool "replicas" }}
{{- if or (gt (int $g.minReplicas) (int $n)) (gt (int $n) (int $g.maxReplicas)) }}
{{- fail (printf "kuberay.%s: %s.replicas (%v) must lie within minReplicas (%v) and maxReplicas (%v)" $pool $pool $n $g.minReplicas $g.maxReplicas) }}
{{- end }}
{{- if and $p.enabled (gt (int $b.maxReplicas) (int $g.maxReplicas)) }}
{{- fail (printf "kuberay.%s.maxReplicas (%v) is below planner.%s.maxReplicas (%v): the Ray autoscaler could not add the pods the planner asks for" $pool $g.maxReplicas $pool $b.maxReplicas) }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "tandem.lifecycle" -}}
lifecycle:
  preStop:
    # Let endpoint removal reach every router and kube-proxy before SIGTERM starts the
    # drain (the process itself drains on SIGTERM: it leaves the registry first).
    exec: {command: ["sleep", "{{ .Values.preStopDelaySeconds }}"]}
{{- end -}}

{{- define "tandem.modelInit" -}}
{{- if eq .Values.model.source "initContainer" }}
initContainers:
  - name: fetch-model
    image: {{ .Values.model.initContainer.image }}
    command: {{- toYaml .Values.model.initContainer.command | nindent 6 }}
    volumeMounts: [{name: model, mountPath: /models}]
    securityContext: {{- toYaml .Values.securityContext | nindent 6 }}
{{- end }}
{{- end -}}

{{/* kuberay mode: Ray's own health over HTTP (the image has no wget for KubeRay's
default exec probes): `ready` on `port` for readiness, the raylet for liveness. */}}
{{- define "tandem.rayProbes" -}}
readinessProbe:
  httpGet: {path: {{ .ready }}, port: {{ .port }}}
  periodSeconds: 5
  failureThreshold: 6
livenessProbe:
  httpGet: {path: /api/local_raylet_healthz, port: 52365}
  periodSeconds: 10
  failureThreshold: 6
startupProbe:
  httpGet: {path: /api/local_raylet_healthz, port: 52365}
  periodSeconds: 5
  failureThreshold: 60
{{- end -}}

{{/* kuberay mode: what the head pod's containers share. /tmp/ray (Ray's session: the
raylet's sockets) is one volume named as KubeRay names it, so the autoscaler it adds
shares it too. */}}
{{- define "tandem.rayMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: ray-logs, mountPath: /tmp/ray}
- {name: shm, mountPath: /dev/shm}
- {name: cache, mountPath: /cache}
{{- include "tandem.modelMount" . }}
{{- end -}}

{{- define "tandem.rayVolumes" -}}
- {name: tmp, emptyDir: {}}
- {name: ray-logs, emptyDir: {}}
- {name: cache, emptyDir: {}}
- name: shm
  emptyDir: {medium: Memory, sizeLimit: {{ .shmSize }}}
{{- include "tandem.modelVolume" .root }}
{{- end -}}

{{/* kuberay mode: the head's `tandem serve --ray` command line, one list item a word. */}}
{{- define "tandem.rayServeArgs" -}}
{{- $k := .Values.kuberay -}}
- serve
- --ray
- --ray-address
- 127.0.0.1:6379
- --ray-namespace
- {{ $k.rayNamespace | quote }}
- --host
- 0.0.0.0
- --grpc-port
- {{ .Values.ports.api | quote }}
- --port
- {{ .Values.ports.http | quote }}
- --metrics-port
- {{ .Values.ports.metrics | quote }}
{{- if ne .Values.model.source "builtin" }}
- --model
- /models/{{ .Values.model.path }}
{{- end }}
{{- with .Values.model.name }}
- --model-name
- {{ . | quote }}
{{- end }}
- --prefill-workers
- {{ .Values.prefill.replicas | quote }}
- --decode-workers
- {{ .Values.decode.replicas | quote }}
- --tensor-parallel-size
- {{ $k.tensorParallelSize | quote }}
- --cpus-per-rank
- {{ $k.cpusPerRank | quote }}
- --gpus-per-rank
- {{ $k.gpusPerRank | quote }}
- --prefill-node-label
- tandem.dev/pool=prefill
- --decode-node-label
- tandem.dev/pool=decode
{{- if $k.kvCacheMemoryGb }}
- --kv-cache-memory-gb
- {{ $k.kvCacheMemoryGb | toString | quote }}
{{- end }}
{{- range $role := list "prefill" "decode" }}
{{- range $resource, $amount := index $k $role "rayResources" }}
- --{{ $role }}-ray-resource
- {{ printf "%s=%v" $resource $amount | quote }}
{{- end }}
{{- end }}
- --router-arg=--health-port={{ .Values.ports.health }}
{{- range include "tandem.loraRouterArgs" . | fromJsonArray }}
- {{ printf "--router-arg=%s" . | quote }}
{{- end }}
{{- range include "tandem.loraWorkerArgs" . | fromJsonArray }}
- {{ printf "--worker-arg=%s" . | quote }}
{{- end }}
{{- if .Values.apiKeys.secretName }}
- --router-arg=--api-key-file=/secrets/api-keys/{{ .Values.apiKeys.secretKey }}
{{- end }}
{{- range .Values.router.args }}
- {{ printf "--router-arg=%s" . | quote }}
{{- end }}
{{- range .Values.engine.args }}
- {{ printf "--worker-arg=%s" . | quote }}
{{- end }}
{{- range .Values.prefill.args }}
- {{ printf "--prefill-worker-arg=%s" . | quote }}
{{- end }}
{{- range .Values.decode.args }}
- {{ printf "--decode-worker-arg=%s" . | quote }}
{{- end }}
{{- if .Values.planner.enabled }}
- --planner
{{ include "tandem.plannerArgs" . | trim }}
{{- end }}
{{- end -}}
