{{/* The rings this release runs: main always, canary when enabled. A JSON list for fromJsonArray. */}}
{{- define "edgekit.rings" -}}
{{- $rings := list (dict "name" "main" "suffix" "" "operator" "NotIn" "image" (dict) "config" (dict)) -}}
{{- if .Values.canary.enabled -}}
{{- $rings = append $rings (dict "name" "canary" "suffix" "-canary" "operator" "In" "image" (.Values.canary.image | default (dict)) "config" (.Values.canary.config | default (dict))) -}}
{{- end -}}
{{- toJson $rings -}}
{{- end -}}

{{- define "edgekit.labels" -}}
app.kubernetes.io/name: edgekitd
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | quote }}
{{- end -}}

{{/* A TOML key: bare when it may be, else quoted. */}}
{{- define "edgekit.tomlKey" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . }}{{ . }}{{ else }}{{ toJson . }}{{ end -}}
{{- end -}}

{{/* One TOML value. Helm reads every number in values as a float64 (its toToml would write workers = 8.0, which
     edgekitd refuses), so a whole number is written as an integer: edgekitd's float settings accept integers. */}}
{{- define "edgekit.tomlValue" -}}
{{- $kind := kindOf . -}}
{{- if eq $kind "string" -}}{{ toJson . }}
{{- else if eq $kind "bool" -}}{{ . }}
{{- else if has $kind (list "float64" "float32" "int" "int64" "int32" "uint64") -}}
{{- if eq (float64 .) (floor .) }}{{ int64 . }}{{ else }}{{ . }}{{ end -}}
{{- else if eq $kind "slice" -}}
[{{ range $i, $x := . }}{{ if $i }}, {{ end }}{{ include "edgekit.tomlValue" $x }}{{ end }}]
{{- else if eq $kind "map" -}}
{ {{- range $i, $key := keys . | sortAlpha }}{{ if $i }},{{ end }} {{ include "edgekit.tomlKey" $key }} = {{ include "edgekit.tomlValue" (get $ $key) }}{{ end }} }
{{- else -}}
{{- fail (printf "config: %v (%s) is not a TOML value" . $kind) -}}
{{- end -}}
{{- end -}}

{{/* edgekitd.toml from a dict of sections: a table per section, [[section]] per item of a list of tables. */}}
{{- define "edgekit.toml" -}}
{{- $cfg := . -}}
{{- range $section := keys $cfg | sortAlpha }}
{{- $table := get $cfg $section }}
{{- if eq (kindOf $table) "slice" }}
{{- range $item := $table }}

[[{{ include "edgekit.tomlKey" $section }}]]
{{- range $key := keys $item | sortAlpha }}
{{ include "edgekit.tomlKey" $key }} = {{ include "edgekit.tomlValue" (get $item $key) }}
{{- end }}
{{- end }}
{{- else if eq (kindOf $table) "map" }}

[{{ include "edgekit.tomlKey" $section }}]
{{- range $key := keys $table | sortAlpha }}
{{ include "edgekit.tomlKey" $key }} = {{ include "edgekit.tomlValue" (get $table $key) }}
{{- end }}
{{- else }}
{{- fail (printf "config.%s must be a table or a list of tables" $section) }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A ring's edgekitd.toml: config, the ring's config over it, then what the chart's mounts fix: the state dir, the
     socket, and [trust] public_keys as the Secret's files (relative to the config file: the one projected volume
     holds edgekitd.toml and trust/). Argument: dict "root" $ "ring" $ring. */}}
{{- define "edgekit.config" -}}
{{- $root := .root -}}
{{- $cfg := mergeOverwrite (deepCopy ($root.Values.config | default (dict))) (deepCopy (.ring.config | default (dict))) -}}
{{- $_ := set $cfg "daemon" (mergeOverwrite (get $cfg "daemon" | default (dict)) (dict "state_dir" "/var/lib/edgekit")) -}}
{{- $_ := set $cfg "listen" (mergeOverwrite (get $cfg "listen" | default (dict)) (dict "socket" "/run/edgekit/edgekitd.sock")) -}}
{{- $keys := list -}}
{{- range $name := keys ($root.Values.trust.publicKeys | default (dict)) | sortAlpha }}
{{- $keys = append $keys (printf "trust/%s" $name) }}
{{- end -}}
{{- $_ := set $cfg "trust" (dict "public_keys" $keys) -}}
# edgekitd.toml for the {{ .ring.name }} ring of release {{ $root.Release.Name }}, rendered by the edgekit chart
# (packaging/edgekitd.toml documents every key).
{{- include "edgekit.toml" $cfg }}
{{ end -}}
