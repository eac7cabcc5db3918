%% @doc The settings convoy accepts: `settings/0' lists each one's key, default
%% and accepted values; the README's Settings table says what each one means.
%% Settings come from the application environment, `convoy:child_spec/1',
%% `convoy:start_link/1' or `convoy:set_config/1' (and `overload' and
%% `block_timeout' per call to `convoy:send/3'); every one of them reports a bad
%% key or value as an `error()'. The module's other functions are convoy's own.

%% Settings: defaults and validation, in one place. Pure.
%%
%% `settings/0' is the only list of settings: each one's key, default and accepted
%% values, written together. `defaults/0', `keys/0' and every check are derived
%% from it, and `convoy_control' fills the `#runtime{}' field of the same name from
%% it, so adding a setting is one row here, one field in `convoy_runtime.hrl', the
%% types below and a row in README's Settings table (test/convoy_settings_tests.erl
%% fails until all of them agree).
%%
%% Every entry point (application environment at start-up, `convoy:child_spec/1',
%% `convoy:start_link/1', `convoy:set_config/1', `convoy:send/3' for its per-call
%% options, and `convoy_channel:open/2' for a channel's options) goes through
%% this module, so a bad key or value is reported the same way wherever it comes
%% from. Only `settings/0' is documented for users (`@private' on the others).
-module(convoy_config).

-export([options/1, settings/0, defaults/0, keys/0, validate/1, merge/2, from_env/1,
         send_options/1, channel_options/1]).

-export_type([config/0, error/0, overload/0, compress/0, accepts/0, channel_config/0]).

-include("convoy_limits.hrl").

-type config() :: #{lanes := pos_integer(),
                    max_batch := pos_integer(),
                    max_delay := non_neg_integer(),
                    large_threshold := non_neg_integer() | infinity,
                    chunk_threshold := non_neg_integer() | infinity,
                    chunk_bytes := pos_integer(),
                    chunk_window := pos_integer(),
                    chunk_guard := non_neg_integer() | always,
                    max_reassembly_bytes := pos_integer() | infinity,
                    barrier_timeout := non_neg_integer(),
                    bypass_after := non_neg_integer() | never,
                    max_buffered := pos_integer() | infinity,
                    max_buffered_bytes := pos_integer() | infinity,
                    overload := overload(),
                    block_timeout := non_neg_integer(),
                    telemetry := boolean(),
                    compress := compress()}.
-type error() :: {bad_option, term()} | {bad_value, atom(), term()} |
                 {duplicate_option, atom()} | {not_a_map, term()}.
%% `bad_option': a key that is not a setting (or not one this entry point takes);
%% `bad_value': a value the key does not accept; options given as a list with a
%% key twice are `duplicate_option'; options that are neither a map nor a list of
%% `{Key, Value}' (an Elixir keyword list) are `not_a_map'.
-type overload() :: block | drop | error.
%% What a sender gets when a node's bound is reached (the `overload' setting).
-type compress() :: never | auto | 1..9.
%% Whether a lane compresses its batches, and at which zlib level, or `auto'
%% (the `compress' setting; see `convoy_compress', `convoy_compress_auto').
-type accepts() :: [atom() | {integer, Min :: integer(), Max :: integer() | unbounded}].
%% A value is accepted when it is one of the atoms, or an integer within one of
%% the (inclusive) ranges.
-type channel_config() :: #{window := pos_integer(),
                            ack_every := pos_integer(),
                            timeout := timeout()}.
%% A channel's options, every one set (`channel_options/1').

%% The settings `convoy:send/3' takes for one call.
-define(SEND_OPTIONS, [overload, block_timeout]).

%% @doc Every setting, in README order: key, default, accepted values.
%%
%% `lanes' (per destination node) defaults to 1: on the 2-core machine this
%% project is measured on, a second lane splits a single sender's traffic
%% nowhere (lanes are chosen per sender) and adds a process competing for the
%% same two schedulers; see
%% doc/decisions.md. Its upper bound is the most inboxes a peer accepts
%% (`convoy_wire'), which keeps the lane and inbox tables small.
%%
%% `chunk_bytes' defaults to 63 KiB so that a piece with its headers (at most
%% about 700 bytes, with node and name atoms of 255 characters sent uncached)
%% fits in one of the runtime's 64 KiB distribution fragments: a piece of 64 KiB
%% traveled as two, which the receiving node joins with one more copy.
%%
%% `chunk_window' defaults to 16: a node's messages in pieces take turns at the
%% receiving inbox, so one sender's window is all that node has in flight there,
%% and 16 moved more bulk than 8 beside small round trips that stayed well under
%% those beside plain sends (doc/decisions.md).
%%
%% `compress' defaults to `never': compressing costs the lane CPU on every batch
%% it ships and pays only where the link, not the CPU, is the limit; `auto' tells
%% the two apart by measuring, but was measured on one host only
%% (doc/decisions.md).
-spec settings() -> [{atom(), term(), accepts()}].
settings() ->
    [{lanes, 1, [{integer, 1, ?MAX_LANES}]},
     {max_batch, 1000, [{integer, 1, 1000000}]},
     {max_delay, 0, [{integer, 0, 10000000}]},
     {large_threshold, 65536, [infinity, {integer, 0, unbounded}]},
     {chunk_threshold, 4 * 1024 * 1024, [infinity, {integer, 0, unbounded}]},
     {chunk_bytes, 63 * 1024, [{integer, 1024, 64 * 1024 * 1024}]},
     {chunk_window, 16, [{integer, 1, ?MAX_CHUNK_WINDOW}]},
     {chunk_guard, 1000, [always, {integer, 0, 3600000}]},
     {max_reassembly_bytes, 256 * 1024 * 1024, [infinity, {integer, 1, unbounded}]},
     {barrier_timeout, 100, [{integer, 0, 60000}]},
     {bypass_after, 20, [never, {integer, 0, 1000000}]},
     {max_buffered, 1000000, [infinity, {integer, 1, unbounded}]},
     {max_buffered_bytes, 64 * 1024 * 1024, [infinity, {integer, 1, unbounded}]},
     {overload, block, [block, drop, error]},
     {block_timeout, 5000, [{integer, 0, ?MAX_BLOCK_MS}]},
     {telemetry, true, [true, false]},
     {compress, never, [never, auto, {integer, 1, 9}]}].

%% @private
%% @doc The settings used where nothing else is given.
-spec defaults() -> config().
defaults() ->
    maps:from_list([{K, D} || {K, D, _} <- settings()]).

%% @private
%% @doc The settings' keys, in README order.
-spec keys() -> [atom()].
keys() -> [K || {K, _, _} <- settings()].

%% @private
%% @doc Options as a map: a map as it is, a list of `{Key, Value}' with atom keys
%% (a proplist, an Elixir keyword list) as the map of its pairs; a key twice in
%% the list is an error, as is anything else.
-spec options(map() | term()) -> {ok, map()} | {error, error()}.
options(Opts) when is_map(Opts) ->
    {ok, Opts};
options(Opts) when is_list(Opts) ->
    pairs(Opts, #{}, Opts);
options(Opts) ->
    {error, {not_a_map, Opts}}.

pairs([], Map, _Opts) ->
    {ok, Map};
pairs([{K, _} | _], Map, _Opts) when is_atom(K), is_map_key(K, Map) ->
    {error, {duplicate_option, K}};
pairs([{K, V} | Rest], Map, Opts) when is_atom(K) ->
    pairs(Rest, Map#{K => V}, Opts);
pairs(_NotAPair, _Map, Opts) ->
    {error, {not_a_map, Opts}}.

%% @private
%% @doc A complete, valid configuration from (partial) options over the defaults.
-spec validate(map() | term()) -> {ok, config()} | {error, error()}.
validate(Opts) -> merge(defaults(), Opts).

%% @private
%% @doc Apply the changes in `Opts' on top of an already valid `Base'.
-spec merge(config(), map() | term()) -> {ok, config()} | {error, error()}.
merge(Base, Opts) ->
    case options(Opts) of
        {ok, Map} ->
            case check(Map, settings()) of
                ok -> {ok, maps:merge(Base, Map)};
                {error, _} = E -> E
            end;
        {error, _} = E ->
            E
    end.

%% @private
%% @doc Settings from an application environment list (`application:get_all_env/1').
%% Keys that OTP itself puts there are ignored; any other unknown key is an error.
-spec from_env([{atom(), term()}]) -> {ok, config()} | {error, error()}.
from_env(Env) ->
    validate(maps:from_list([KV || {K, _} = KV <- Env, K =/= included_applications])).

%% @private
%% @doc `convoy:send/3''s options: `overload' and `block_timeout', with the same
%% bounds as the settings; unset keys are left unset (the call takes the settings').
-spec send_options(map() | term()) -> {ok, convoy:send_options()} | {error, error()}.
send_options(Opts) when map_size(Opts) =:= 0 ->
    {ok, Opts};
send_options(Opts = #{overload := O}) when map_size(Opts) =:= 1,
                                           O =:= drop orelse O =:= error orelse O =:= block ->
    %% the common case, checked without walking the settings (a call's cost)
    {ok, Opts};
send_options(Opts) when is_map(Opts) ->
    case check(Opts, settings(), ?SEND_OPTIONS) of
        ok -> {ok, Opts};
        {error, _} = E -> E
    end;
send_options(Opts) ->
    case options(Opts) of
        {ok, Map} -> send_options(Map);
        {error, _} = E -> E
    end.

%% A channel's options (`convoy_channel:open/2'), as `settings/0' lists the
%% settings: key, default, accepted values. `ack_every''s default, `derived', is
%% `max(1, window div 2)'; it may not exceed `window' (`channel_options/1').
channel_settings() ->
    [{window, 1000, [{integer, 1, unbounded}]},
     {ack_every, derived, [{integer, 1, unbounded}]},
     {timeout, infinity, [infinity, {integer, 0, ?MAX_RECEIVE_MS}]}].

%% @private
%% @doc A channel's options with the defaults filled in, checked as the settings
%% are, with the same errors: an unknown key is `{bad_option, Key}', a bad value
%% `{bad_value, Key, Value}', and `ack_every' above `window' is a bad value of
%% `ack_every'.
-spec channel_options(map() | term()) -> {ok, channel_config()} | {error, error()}.
channel_options(Opts) when not is_map(Opts) ->
    case options(Opts) of
        {ok, Map} -> channel_options(Map);
        {error, _} = E -> E
    end;
channel_options(Opts) ->
    case check(Opts, channel_settings()) of
        ok ->
            Defaults = maps:from_list([{K, D} || {K, D, _} <- channel_settings(),
                                                 D =/= derived]),
            C = #{window := W} = maps:merge(Defaults, Opts),
            case maps:get(ack_every, C, max(1, W div 2)) of
                A when A =< W -> {ok, C#{ack_every => A}};
                A -> {error, {bad_value, ack_every, A}}
            end;
        {error, _} = E ->
            E
    end.

%% The first key of `Opts' not among `Rows' (`{Key, Default, Accepts}') or not
%% `Allowed', or the first bad value.
check(Opts, Rows) ->
    check(Opts, Rows, all).

check(Opts, Rows, Allowed) ->
    check_each(maps:to_list(Opts), Rows, Allowed).

check_each([], _Rows, _Allowed) ->
    ok;
check_each([{K, V} | Rest], Rows, Allowed) ->
    case (Allowed =:= all orelse lists:member(K, Allowed)) andalso lists:keyfind(K, 1, Rows) of
        {K, _, Accepts} ->
            case lists:any(fun(A) -> accepts(A, V) end, Accepts) of
                true -> check_each(Rest, Rows, Allowed);
                false -> {error, {bad_value, K, V}}
            end;
        false ->
            {error, {bad_option, K}}
    end.

accepts({integer, Min, unbounded}, V) -> is_integer(V) andalso V >= Min;
accepts({integer, Min, Max}, V) -> is_integer(V) andalso V >= Min andalso V =< Max;
accepts(Atom, V) -> V =:= Atom.

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

%% A keyword list (Elixir's habit, a proplist in Erlang) means the map of its
%% pairs; anything else is named as not a map.
keyword_list_test() ->
    ?assertEqual(validate(#{lanes => 2, overload => drop}),
                 validate([{lanes, 2}, {overload, drop}])),
    ?assertEqual({ok, defaults()}, validate([])),
    ?assertEqual({error, {bad_option, nope}}, validate([{nope, 1}])),
    ?assertEqual({error, {duplicate_option, lanes}}, validate([{lanes, 1}, {lanes, 2}])),
    ?assertEqual({error, {not_a_map, [lanes]}}, validate([lanes])),
    ?assertEqual({error, {not_a_map, [{"lanes", 1}]}}, validate([{"lanes", 1}])),
    ?assertEqual({error, {not_a_map, {lanes, 1}}}, validate({lanes, 1})),
    ?assertEqual({error, {not_a_map, [{lanes, 1} | x]}}, validate([{lanes, 1} | x])),
    ?assertMatch({ok, #{window := 10, ack_every := 5}}, channel_options([{window, 10}])),
    ?assertEqual({error, {not_a_map, 10}}, channel_options(10)).

defaults_are_valid_test() ->
    ?assertEqual({ok, defaults()}, validate(#{})).

one_row_per_key_test() ->
    ?assertEqual(length(keys()), length(lists:usort(keys()))).

%% Every default is among its own accepted values (a row cannot contradict itself).
defaults_accepted_test() ->
    [?assertEqual({ok, defaults()}, validate(#{K => D})) || {K, D, _} <- settings()].

unknown_key_named_test() ->
    ?assertEqual({error, {bad_option, lane}}, validate(#{lane => 2})).

bad_value_named_test() ->
    ?assertEqual({error, {bad_value, lanes, 0}}, validate(#{lanes => 0})),
    ?assertEqual({error, {bad_value, max_delay, -1}}, validate(#{max_delay => -1})),
    ?assertEqual({error, {bad_value, telemetry, yes}}, validate(#{telemetry => yes})),
    ?assertEqual({error, {bad_value, lanes, 1025}}, validate(#{lanes => 1025})),
    ?assertEqual({error, {bad_value, max_batch, 1.0}}, validate(#{max_batch => 1.0})).

not_a_map_test() ->
    ?assertEqual({error, {not_a_map, [lanes]}}, validate([lanes])).

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
    ?assertEqual({error, {bad_value, max_buffered_bytes, 0}}, validate(#{max_buffered_bytes => 0})),
    ?assertMatch({ok, #{block_timeout := 3600000}}, validate(#{block_timeout => 3600000})),
    ?assertEqual({error, {bad_value, block_timeout, 3600001}},
                 validate(#{block_timeout => 3600001})),
    ?assertEqual({error, {bad_value, bypass_after, infinity}},
                 validate(#{bypass_after => infinity})).

%% A zlib level, `auto' or `never', from a map or a keyword list alike.
compress_test() ->
    ?assertMatch({ok, #{compress := never}}, validate(#{})),
    ?assertMatch({ok, #{compress := 1}}, validate(#{compress => 1})),
    ?assertMatch({ok, #{compress := 9}}, validate([{compress, 9}])),
    ?assertMatch({ok, #{compress := auto}}, validate([{compress, auto}])),
    [?assertEqual({error, {bad_value, compress, V}}, validate(#{compress => V}))
     || V <- [0, 10, -1, true, automatic, 6.0, "6"]].

large_threshold_infinity_test() ->
    ?assertMatch({ok, #{large_threshold := infinity}},
                 validate(#{large_threshold => infinity})).

send_options_test() ->
    ?assertEqual({ok, #{}}, send_options(#{})),
    Opts = #{overload => error, block_timeout => 0},
    ?assertEqual({ok, Opts}, send_options(Opts)),
    ?assertEqual({error, {bad_option, lanes}}, send_options(#{lanes => 2})),
    ?assertEqual({error, {bad_option, nope}}, send_options(#{nope => 1})),
    ?assertEqual({error, {not_a_map, [overload]}}, send_options([overload])),
    ?assertEqual({ok, #{overload => drop}}, send_options([{overload, drop}])),
    ?assertEqual({error, {bad_value, overload, later}}, send_options([{overload, later}])),
    ?assertEqual({error, {duplicate_option, overload}},
                 send_options([{overload, drop}, {overload, error}])),
    ?assertEqual({error, {not_a_map, overload}}, send_options(overload)),
    ?assertEqual({error, {bad_value, overload, later}}, send_options(#{overload => later})),
    ?assertEqual({error, {bad_value, block_timeout, -1}}, send_options(#{block_timeout => -1})).

channel_options_test() ->
    ?assertEqual({ok, #{window => 1000, ack_every => 500, timeout => infinity}},
                 channel_options(#{})),
    ?assertEqual({ok, #{window => 1, ack_every => 1, timeout => 0}},
                 channel_options(#{window => 1, timeout => 0})),
    ?assertEqual({ok, #{window => 7, ack_every => 7, timeout => ?MAX_RECEIVE_MS}},
                 channel_options(#{window => 7, ack_every => 7, timeout => ?MAX_RECEIVE_MS})),
    ?assertEqual({error, {bad_option, lanes}}, channel_options(#{lanes => 1})),
    ?assertEqual({error, {not_a_map, [window]}}, channel_options([window])),
    ?assertEqual({error, {bad_value, window, 0}}, channel_options(#{window => 0})),
    ?assertEqual({error, {bad_value, ack_every, 3}},
                 channel_options(#{window => 2, ack_every => 3})),
    ?assertEqual({error, {bad_value, ack_every, 1001}}, channel_options(#{ack_every => 1001})),
    ?assertEqual({error, {bad_value, timeout, ?MAX_RECEIVE_MS + 1}},
                 channel_options(#{timeout => ?MAX_RECEIVE_MS + 1})).

%% The per-call options take exactly the settings' bounds.
send_options_bounds_as_settings_test() ->
    Values = [-1, 0, 1, 3600000, 3600001, infinity, never, block, drop, error, later, 1.5],
    [?assertEqual(element(1, validate(#{K => V})), element(1, send_options(#{K => V})))
     || K <- ?SEND_OPTIONS, V <- Values].
-endif.
