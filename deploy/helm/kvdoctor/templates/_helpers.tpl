{{/* Names and labels. */}}
{{- define "kvdoctor.name" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvdoctor.selectorLabels" -}}
app.kubernetes.io/name: kvdoctor-vllm
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvdoctor.labels" -}}
{{ include "kvdoctor.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- with .Values.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
The kvdoctor sidecar: a native sidecar (init container, restartPolicy: Always). Include it in
your own vLLM pod's initContainers with the same values:
  initContainers:
    {{- include "kvdoctor.sidecar" . | nindent 4 }}
It has no readinessProbe and no startupProbe: Kubernetes counts a native sidecar's readiness in
the Pod's Ready condition, and a startupProbe holds the next containers' start.
*/}}
{{- define "kvdoctor.sidecar" -}}
- name: kvdoctor
  image: {{ .Values.kvdoctor.image }}
  imagePullPolicy: {{ .Values.kvdoctor.imagePullPolicy }}
  restartPolicy: Always
  args:
    - sidecar
    - --listen=0.0.0.0:{{ .Values.kvdoctor.port }}
    - --metrics=http://127.0.0.1:{{ .Values.vllm.port }}/metrics
    {{- if .Values.kvdoctor.followLog }}
    - --log={{ .Values.vllm.logDir }}/vllm.log
    {{- end }}
    {{- if not .Values.kvdoctor.nvml }}
    - --no-nvml
    {{- end }}
    - --interval={{ .Values.kvdoctor.interval }}
    - --history={{ .Values.kvdoctor.history }}
    {{- range .Values.kvdoctor.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- if .Values.kvdoctor.nvml }}
    - {name: NVIDIA_VISIBLE_DEVICES, value: all}
    - {name: NVIDIA_DRIVER_CAPABILITIES, value: utility}
    {{- end }}
    # the downward API: every JSON log line of the sidecar names its pod (the series get
    # namespace/pod from the scrape: the PodMonitor or the scrape config)
    - name: POD_NAMESPACE
      valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
    - name: POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
  ports:
    - {name: kvdoctor, containerPort: {{ .Values.kvdoctor.port }}}
  {{- if .Values.kvdoctor.livenessProbe.enabled }}
  livenessProbe:
    httpGet: {path: /healthz, port: kvdoctor}
    periodSeconds: {{ .Values.kvdoctor.livenessProbe.periodSeconds }}
    timeoutSeconds: {{ .Values.kvdoctor.livenessProbe.timeoutSeconds }}
    failureThreshold: {{ .Values.kvdoctor.livenessProbe.failureThreshold }}
  {{- end }}
  resources:
    {{- toYaml .Values.kvdoctor.resources | nindent 4 }}
  securityContext:
    readOnlyRootFilesystem: true
    allowPrivilegeEscalation: false
    capabilities: {drop: [ALL]}
  volumeMounts:
    - {name: kvdoctor-tmp, mountPath: /tmp}
    {{- if .Values.kvdoctor.followLog }}
    - {name: vllm-log, mountPath: {{ .Values.vllm.logDir }}, readOnly: true}
    {{- end }}
{{- end -}}
