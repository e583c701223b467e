{{/*
metax-operator.seedSpellings: the product manual's spellings of two options (seed table 3.1
`vfio-manager`, §3.1 `driver.enableRollout`) read as the chart's keys (`vfioManager`,
`driver.upgradePolicy.enableRollout`). Takes the root context and renders nothing: it writes each
leaf of a seed spelling to the same leaf of the chart's key in .Values, and fails the render when
that leaf holds a value other than the chart's default and the seed spelling's (both named).

Every template begins with it: Helm renders the templates in an order of its own, all with the
one .Values, so each makes sure the values it reads are normalised; a second call changes nothing.
The same rule, with the same sentences: src/metax_operator/chart/seed_spellings.py.
*/}}
{{- define "metax-operator.seedSpellings" -}}
{{- $errors := list -}}
{{- range $spelling := include "metax-operator.seedSpellingList" . | fromJsonArray -}}
  {{- $parent := $.Values -}}
  {{- range initial $spelling.seed }}{{ $parent = get (ternary $parent dict (kindIs "map" $parent)) . }}{{ end -}}
  {{- $at := last $spelling.seed -}}
  {{- if and (kindIs "map" $parent) (hasKey $parent $at) (not (kindIs "invalid" (get $parent $at))) -}}
    {{- $into := $.Values -}}
    {{- range initial $spelling.key }}{{ $into = get $into . }}{{ end -}}
    {{- $seed := join "." $spelling.seed -}}
    {{- $key := join "." $spelling.key -}}
    {{- $lines := include "metax-operator.seedSpellingMerge" (dict "value" (get $parent $at) "into" $into "at" (last $spelling.key) "default" $spelling.default "hasDefault" true "seedName" $seed "keyName" $key "seed" $seed "key" $key) -}}
    {{- range splitList "\n" $lines }}{{ if . }}{{ $errors = append $errors . }}{{ end }}{{ end -}}
  {{- end -}}
{{- end -}}
{{- if $errors -}}
  {{- fail (printf "invalid values:\n%s" (join "\n" $errors)) -}}
{{- end -}}
{{- end }}

{{/* One leaf (or mapping) of a seed spelling written into the chart's key: `value` at key `at` of
the mapping `into`, the chart's default there (`hasDefault`: whether there is one), the dotted
names of both spellings' leaves and of the whole options. Renders one line per conflict. */}}
{{- define "metax-operator.seedSpellingMerge" -}}
{{- if and (kindIs "map" .value) .value -}}
  {{- if not (kindIs "map" (get .into .at)) }}{{ $_ := set .into .at dict }}{{ end -}}
  {{- $into := get .into .at -}}
  {{- $default := ternary .default dict (kindIs "map" .default) -}}
  {{- range $k, $v := .value -}}
    {{- include "metax-operator.seedSpellingMerge" (dict "value" $v "into" $into "at" $k "default" (get $default $k) "hasDefault" (and $.hasDefault (hasKey $default $k)) "seedName" (printf "%s.%s" $.seedName $k) "keyName" (printf "%s.%s" $.keyName $k) "seed" $.seed "key" $.key) -}}
  {{- end -}}
{{- else -}}
  {{- $have := get .into .at -}}
  {{- if and (hasKey .into .at) (ne (toJson $have) (toJson .value)) (or (not .hasDefault) (ne (toJson $have) (toJson .default))) }}
{{ printf "%s: is %s but %s is %s; they are one option (%s is the product manual's spelling of %s): set only %s" .seedName (toJson .value) .keyName (toJson $have) .seed .key .keyName }}
  {{- else -}}
    {{- $_ := set .into .at .value -}}
  {{- end -}}
{{- end -}}
{{- end }}

{{/* The notices of the seed spellings the values give, one line each (NOTES.txt). */}}
{{- define "metax-operator.seedSpellingNotices" -}}
{{- range $spelling := include "metax-operator.seedSpellingList" . | fromJsonArray -}}
  {{- $parent := $.Values -}}
  {{- range initial $spelling.seed }}{{ $parent = get (ternary $parent dict (kindIs "map" $parent)) . }}{{ end -}}
  {{- $at := last $spelling.seed -}}
  {{- if and (kindIs "map" $parent) (hasKey $parent $at) (not (kindIs "invalid" (get $parent $at))) }}
{{ printf "%s: is the product manual's spelling of %s and is read as it; write %s" (join "." $spelling.seed) (join "." $spelling.key) (join "." $spelling.key) }}
  {{- end -}}
{{- end -}}
{{- end }}
