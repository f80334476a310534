{{- define "hybridcache.fullname" -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "hybridcache.labels" -}}
app.kubernetes.io/name: hybridcache-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: hybridcache
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "hybridcache.selectorLabels" -}}
app.kubernetes.io/name: hybridcache-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "hybridcache.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "hybridcache.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "hybridcache.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
