%% Each setting is declared once, in convoy_config:settings/0. These tests fail
%% when the places that must follow it drift apart: the `#runtime{}' record (and
%% convoy_control filling it), the types `convoy_config:config()',
%% `convoy:options()' and `convoy:send_options()', and README's Settings table.
-module(convoy_settings_tests).

-include_lib("eunit/include/eunit.hrl").
-include("../src/convoy_runtime.hrl").

%% Every setting but `lanes' (the runtime has the count as `n' and the lane pids
%% as `lanes') is a field of the runtime record.
settings_are_runtime_fields_test() ->
    Fields = record_info(fields, runtime),
    ?assertEqual([], (convoy_config:keys() -- [lanes]) -- Fields),
    ?assert(lists:member(n, Fields)).

%% convoy_control publishes every setting in its field, at start and after
%% set_config/1, with values unlike the defaults so a field left at a default or
%% filled from the wrong key shows.
runtime_carries_the_settings_test_() ->
    {timeout, 60, fun runtime_carries_the_settings/0}.

runtime_carries_the_settings() ->
    Defaults = convoy_config:defaults(),
    Changed = maps:from_list([{K, other_value(D, A)} || {K, D, A} <- convoy_config:settings()]),
    {ok, Sup} = convoy:start_link(Changed),
    unlink(Sup),
    try
        assert_runtime(Changed),
        ok = convoy:set_config(maps:remove(lanes, Defaults)),
        assert_runtime(Defaults#{lanes := maps:get(lanes, Changed)})
    after
        ok = proc_lib:stop(Sup, shutdown, infinity)
    end.

assert_runtime(Config) ->
    RT = persistent_term:get(?RUNTIME_KEY),
    Fields = lists:zip(record_info(fields, runtime), tl(tuple_to_list(RT))),
    ?assertEqual(maps:remove(lanes, Config),
                 maps:with(convoy_config:keys() -- [lanes], maps:from_list(Fields))),
    ?assertEqual(maps:get(lanes, Config), RT#runtime.n),
    ?assertEqual(Config, RT#runtime.config),
    ?assertMatch(#runtime{stopping = false, refuse = drop}, RT).

%% An accepted value other than the default.
other_value(Default, Accepts) ->
    Candidates = lists:append([case A of
                                   {integer, Min, _} -> [Min, Min + 1];
                                   Atom -> [Atom]
                               end || A <- Accepts]),
    hd([V || V <- Candidates, V =/= Default]).

%% The hand-written types name exactly the settings (Dialyzer cannot check that
%% a new setting was added to them).
types_name_every_setting_test() ->
    Keys = lists:sort(convoy_config:keys()),
    ?assertEqual(Keys, type_keys(convoy_config, config)),
    ?assertEqual(Keys, type_keys(convoy, options)),
    SendKeys = type_keys(convoy, send_options),
    ?assertEqual([], SendKeys -- Keys),
    Defaults = convoy_config:defaults(),
    [?assertEqual({ok, #{K => maps:get(K, Defaults)}},
                  convoy_config:send_options(#{K => maps:get(K, Defaults)}))
     || K <- SendKeys].

%% Keys of a map type, from the module's debug_info.
type_keys(Module, Type) ->
    {ok, {Module, [{abstract_code, {raw_abstract_v1, Forms}}]}} =
        beam_lib:chunks(code:which(Module), [abstract_code]),
    [Fields] = [Fs || {attribute, _, type, {T, {type, _, map, Fs}, []}} <- Forms, T =:= Type],
    lists:sort([K || {type, _, _, [{atom, _, K}, _]} <- Fields]).

%% README's Settings table lists exactly the settings, in the same order, with
%% their defaults.
readme_settings_table_test() ->
    Rows = readme_settings_rows(),
    ?assertEqual([{K, format(D)} || {K, D, _} <- convoy_config:settings()], Rows).

format(Term) -> lists:flatten(io_lib:format("~0p", [Term])).

%% Rows `| `key` | `default` | ...' of the first table under "## Settings".
readme_settings_rows() ->
    {ok, Text} = file:read_file(filename:join(project_root(), "README.md")),
    Lines = string:split(Text, "\n", all),
    [_ | AfterHeading] = lists:dropwhile(fun(L) -> L =/= <<"## Settings">> end, Lines),
    Table = lists:takewhile(fun(<<"|", _/binary>>) -> true; (_) -> false end,
                            lists:dropwhile(fun(<<"|", _/binary>>) -> false; (_) -> true end,
                                            AfterHeading)),
    [_Header, _Rule | Body] = Table,
    [case re:run(Row, "^\\| `([a-z_]+)` \\| `([^`]+)` \\|", [{capture, all_but_first, list}]) of
         {match, [K, D]} -> {list_to_atom(K), D};
         nomatch -> error({unexpected_settings_row, Row})
     end || Row <- Body].

%% doc/design.md's table of the adaptive policy's constants lists exactly
%% convoy_policy.hrl's, with their values.
design_policy_table_test() ->
    {ok, Text} = file:read_file(filename:join([project_root(), "doc", "design.md"])),
    {match, Rows} = re:run(Text, "^\\| `([A-Z_0-9]+)` \\| ([0-9]+) \\|",
                           [global, multiline, {capture, all_but_first, binary}]),
    Table = maps:from_list([{binary_to_atom(Name), binary_to_integer(Value)}
                            || [Name, Value] <- Rows]),
    ?assertEqual(length(Rows), map_size(Table)),
    ?assertEqual(convoy_path:constants(), Table).

%% README's telemetry table lists exactly the events the code emits: every
%% `[convoy, _, _]' written in src/ outside comments.
readme_events_table_test() ->
    Root = project_root(),
    {ok, Readme} = file:read_file(filename:join(Root, "README.md")),
    Documented = events(Readme, "^\\| `\\[convoy, ([a-z_]+), ([a-z_]+)\\]` \\|"),
    Emitted = lists:usort(
                lists:append([events(code_lines(F), "\\[convoy, ([a-z_]+), ([a-z_]+)\\]")
                              || F <- filelib:wildcard(filename:join([Root, "src", "*.erl"]))])),
    ?assertNotEqual([], Emitted),
    ?assertEqual(Emitted, lists:usort(Documented)).

events(Text, Re) ->
    case re:run(Text, Re, [global, multiline, {capture, all_but_first, list}]) of
        {match, Ms} -> [{list_to_atom(A), list_to_atom(B)} || [A, B] <- Ms];
        nomatch -> []
    end.

%% A source file without its comments.
code_lines(File) ->
    {ok, Text} = file:read_file(File),
    [[Code, "\n"] || Line <- string:split(Text, "\n", all),
                     [Code | _] <- [string:split(Line, "%")]].

%% The checkout convoy was compiled from: where its source was, or else the
%% nearest directory above its beam holding the README (rebar3 puts beams in
%% _build/PROFILE/lib/convoy/ebin).
project_root() ->
    Source = proplists:get_value(source, convoy:module_info(compile)),
    Beam = filename:absname(code:which(convoy)),
    Candidates = [filename:dirname(filename:dirname(Source)) || is_list(Source)]
                 ++ ancestors(filename:dirname(Beam)),
    case [D || D <- Candidates, filelib:is_regular(filename:join(D, "README.md")),
               filelib:is_regular(filename:join([D, "src", "convoy.app.src"]))] of
        [Root | _] -> Root;
        [] -> error({readme_not_found, Candidates})
    end.

ancestors(Dir) ->
    case filename:dirname(Dir) of
        Dir -> [Dir];
        Parent -> [Dir | ancestors(Parent)]
    end.

%% send/3 and child_spec/1 reject what convoy_config rejects, naming the key,
%% with the caller's arguments in the error (as erlang:error/2 gives them).
send_options_named_test() ->
    Opts = #{block_timeout => 3600001},
    ?assertEqual([self(), x, Opts],
                 error_args({badarg, {bad_value, block_timeout, 3600001}},
                            fun() -> convoy:send(self(), x, Opts) end)),
    ?assertError({badarg, {bad_option, lanes}}, convoy:send(self(), x, #{lanes => 2})),
    ?assertEqual(ok, convoy:send(self(), x, #{overload => error, block_timeout => 3600000})),
    receive x -> ok after 0 -> error(not_sent) end.

child_spec_named_test() ->
    ?assertEqual([#{max_delay => -1}],
                 error_args({badarg, {bad_value, max_delay, -1}},
                            fun() -> convoy:child_spec(#{max_delay => -1}) end)),
    ?assertError({badarg, {not_a_map, [lanes]}}, convoy:child_spec([lanes])),
    ?assertMatch(#{id := convoy, start := {convoy, start_link, [#{lanes := 2}]}},
                 convoy:child_spec(#{lanes => 2})).

error_args(Reason, Fun) ->
    try Fun() of
        Result -> error({no_error, Result})
    catch
        error:Reason:Stack ->
            [{convoy, _, Args, _} | _] = Stack,
            Args
    end.
