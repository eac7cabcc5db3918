%% @private
%% Settings: defaults and validation, in one place. Pure.
%%
%% Every entry point (application environment at start-up, `convoy:child_spec/1',
%% `convoy:set_config/1') goes through `validate/1' or `merge/2', so a bad key or
%% value is reported the same way wherever it comes from.
-module(convoy_config).

-export([defaults/0, keys/0, validate/1, merge/2, from_env/1]).

-export_type([config/0, error/0, overload/0]).

-type config() :: #{lanes := pos_integer(),
                    max_batch := pos_integer(),
                    max_delay := non_neg_integer(),
                    large_threshold := non_neg_integer() | infinity,
                    barrier_timeout := non_neg_integer(),
                    bypass_after := non_neg_integer() | never,
                    max_buffered := pos_integer() | infinity,
                    max_buffered_bytes := pos_integer() | infinity,
                    overload := overload(),
                    block_timeout := non_neg_integer(),
                    telemetry := boolean()}.
-type error() :: {bad_option, term()} | {bad_value, atom(), term()}.
-type overload() :: block | drop | error.

-define(MAX_LANES, 1024).

%% @doc The settings used where nothing else is given.
%%
%% `lanes' is 1: on the 2-core machine this project is measured on, a second lane
%% splits a single sender's traffic nowhere (lanes are chosen per sender) and adds a
%% process competing for the same two schedulers; see README "Choosing lanes".
-spec defaults() -> config().
defaults() ->
    #{lanes => 1,
      max_batch => 1000,
      max_delay => 0,
      large_threshold => 65536,
      barrier_timeout => 100,
      bypass_after => 20,
      max_buffered => 1000000,
      max_buffered_bytes => 64 * 1024 * 1024,
      overload => block,
      block_timeout => 5000,
      telemetry => true}.

-spec keys() -> [atom()].
keys() -> maps:keys(defaults()).

%% @doc A complete, valid configuration from a (partial) map over the defaults.
-spec validate(map() | term()) -> {ok, config()} | {error, error()}.
validate(Opts) -> merge(defaults(), Opts).

%% @doc Apply the changes in `Opts' on top of an already valid `Base'.
-spec merge(config(), map() | term()) -> {ok, config()} | {error, error()}.
merge(Base, Opts) when is_map(Opts) ->
    check(maps:to_list(Opts), Base);
merge(_Base, Opts) ->
    {error, {bad_option, Opts}}.

%% @doc Settings from an application environment list (`application:get_all_env/1').
%% Keys that OTP itself puts there are ignored; any other unknown key is an error.
-spec from_env([{atom(), term()}]) -> {ok, config()} | {error, error()}.
from_env(Env) ->
    validate(maps:from_list([KV || {K, _} = KV <- Env, K =/= included_applications])).

check([], Acc) ->
    {ok, Acc};
check([{Key, Value} | Rest], Acc) ->
    case is_map_key(Key, Acc) of
        false ->
            {error, {bad_option, Key}};
        true ->
            case valid(Key, Value) of
                true -> check(Rest, Acc#{Key := Value});
                false -> {error, {bad_value, Key, Value}}
            end
    end.

valid(lanes, V) -> is_integer(V) andalso V >= 1 andalso V =< ?MAX_LANES;
valid(max_batch, V) -> is_integer(V) andalso V >= 1 andalso V =< 1000000;
valid(max_delay, V) -> is_integer(V) andalso V >= 0 andalso V =< 10000000;
valid(large_threshold, infinity) -> true;
valid(large_threshold, V) -> is_integer(V) andalso V >= 0;
valid(max_buffered, V) -> V =:= infinity orelse (is_integer(V) andalso V >= 1);
valid(max_buffered_bytes, V) -> V =:= infinity orelse (is_integer(V) andalso V >= 1);
valid(overload, V) -> V =:= block orelse V =:= drop orelse V =:= error;
valid(block_timeout, V) -> is_integer(V) andalso V >= 0 andalso V =< 3600000;
valid(bypass_after, never) -> true;
valid(bypass_after, V) -> is_integer(V) andalso V >= 0 andalso V =< 1000000;
valid(barrier_timeout, V) -> is_integer(V) andalso V >= 0 andalso V =< 60000;
valid(telemetry, V) -> is_boolean(V).

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

defaults_are_valid_test() ->
    ?assertEqual({ok, defaults()}, validate(#{})).

unknown_key_named_test() ->
    ?assertEqual({error, {bad_option, lane}}, validate(#{lane => 2})).

bad_value_named_test() ->
    ?assertEqual({error, {bad_value, lanes, 0}}, validate(#{lanes => 0})),
    ?assertEqual({error, {bad_value, max_delay, -1}}, validate(#{max_delay => -1})),
    ?assertEqual({error, {bad_value, telemetry, yes}}, validate(#{telemetry => yes})),
    ?assertEqual({error, {bad_value, lanes, 1025}}, validate(#{lanes => 1025})).

not_a_map_test() ->
    ?assertEqual({error, {bad_option, [lanes]}}, validate([lanes])).

merge_keeps_base_test() ->
    {ok, C1} = validate(#{lanes => 4}),
    {ok, C2} = merge(C1, #{max_batch => 10}),
    ?assertMatch(#{lanes := 4, max_batch := 10}, C2).

from_env_ignores_included_applications_test() ->
    ?assertMatch({ok, #{lanes := 2}},
                 from_env([{included_applications, []}, {lanes, 2}])),
    ?assertEqual({error, {bad_option, bogus}}, from_env([{bogus, 1}])).

bounds_test() ->
    ?assertMatch({ok, #{max_buffered := infinity, overload := drop}},
                 validate(#{max_buffered => infinity, overload => drop})),
    ?assertEqual({error, {bad_value, overload, later}}, validate(#{overload => later})),
    ?assertEqual({error, {bad_value, max_buffered_bytes, 0}}, validate(#{max_buffered_bytes => 0})).

large_threshold_infinity_test() ->
    ?assertMatch({ok, #{large_threshold := infinity}},
                 validate(#{large_threshold => infinity})).
-endif.
