%% The application resource file says what the application does: its
%% `registered' list is exactly the names convoy's processes hold once it has
%% started with its default settings.
-module(convoy_app_tests).

-include_lib("eunit/include/eunit.hrl").

registered_names_test_() ->
    {timeout, 60, fun registered_names/0}.

registered_names() ->
    undefined = whereis(convoy_sup), % no other start of convoy is running
    ok = application:load(convoy),
    [] = application:get_all_env(convoy) -- [{included_applications, []}],
    {ok, Listed} = application:get_key(convoy, registered),
    {ok, _} = application:ensure_all_started(convoy),
    try
        %% Every process convoy starts, itself or through its processes, has the
        %% application master as its group leader.
        Master = application_controller:get_master(convoy),
        Held = lists:usort([Name || P <- processes(),
                                    {group_leader, GL} <- [process_info(P, group_leader)],
                                    GL =:= Master,
                                    {registered_name, Name} <- [process_info(P, registered_name)]]),
        ?assertEqual(lists:usort(Listed), Held)
    after
        ok = application:stop(convoy)
    end.
