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
{{- end -}}

{{/* Model weights: the image's built-in model, a PVC, a hostPath or an init container. */}}
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
readinessProbe:
  grpc: {port: {{ .Values.ports.health }}, service: ""}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  grpc: {port: {{ .Values.ports.health }}, service: tandem.liveness}
  periodSeconds: 10
  failureThreshold: 6
startupProbe:
  grpc: {port: {{ .Values.ports.health }}, service: tandem.liveness}
  periodSeconds: 5
  failureThreshold: {{ .Values.startupTimeoutSeconds | div 5 }}
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
